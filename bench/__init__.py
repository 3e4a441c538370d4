"""Training-speed benchmarks: the speed ladder (bench.ladder) and its external peer rows (bench.peer)."""
