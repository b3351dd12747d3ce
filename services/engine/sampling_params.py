"""SamplingParams lives in services/serving (torch-free), so the router validates requests
with the engine's own rules; the engine's name for it stays here."""

from services.serving.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
