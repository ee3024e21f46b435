"""Layer 2, the stage functions and the run directory: config, datasets, the Parquet store, the five
stages, rerun, the run's resources and summary, reports. Plain functions, testable without Prefect."""
