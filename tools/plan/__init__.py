"""The planner: a profile of this machine, a simulator on it, and the search over topologies."""
