"""Problems, datasets and benchmarks (hub ids and local files), prompt templates, synthetic tasks."""
