"""Model implementations written for the flat paged batch."""
