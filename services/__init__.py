"""What every service is built from: the serving pieces, the engine, the workers' shared
parts, and the benchmarks."""
