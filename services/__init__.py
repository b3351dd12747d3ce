"""What every service is built from: the engine and the serving bootstrap."""
