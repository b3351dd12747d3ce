"""Tools, not building blocks: the benchmarks (`bench/`) and the demo. Nothing in
Baton imports them."""
