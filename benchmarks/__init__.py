"""hookax benchmarks: ``python -m benchmarks [name ...]`` (or ``make bench``)."""
