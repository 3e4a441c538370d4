"""Training-speed benchmarks: the speed ladder (bench.ladder) and the external peer runner (bench.peer)."""
