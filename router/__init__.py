"""The public front door: the Generation API, admission, routing and P/D orchestration.
Torch-free."""
