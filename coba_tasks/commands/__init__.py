"""What a user types: the ``coba`` command line, inspection, the strategy comparison and the benchmarks.
The only layer of the library that imports ``flows/``."""
