"""The heavy machines: rollout backends (vLLM, transformers, Ray), verifiers, the GRPO trainer and its
FSDP job, engine sleep, and the tiny model. They take tensors, token ids and paths; no Prefect, no run
directory."""
