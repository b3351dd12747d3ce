"""Autoscaling targets per role, from a profile and the SLO: what one pod may carry on
average before the autoscaler adds another (a Kubernetes HorizontalPodAutoscaler's Pods
metric, averaged over the role's pods; deploy/kubernetes/examples/autoscaling.yaml).

    prefill  baton:num_queued_prefill_tokens, the prompt tokens a prefill worker has yet
             to compute: what it computes in half the TTFT target (the other half is
             left for the request's own prompt and the hand-off)
    decode   baton:num_requests_running: the largest decode batch whose served step, at
             the workload's mean context, stays within the ITL target
"""

from __future__ import annotations

from .calibrate import cost
from .simulator import Topology, engine_profile
from .step_model import StepModel


def targets(profile: dict, topology: Topology, slo_ttft_s: float, slo_itl_s: float,
            context: int) -> dict:
    out = {}
    if topology.prefill:
        e = engine_profile(profile, topology.prefill_threads, topology.prefill_tp)
        model, chunk = StepModel.from_json(e["model"]), topology.max_num_batched_tokens
        step = [(chunk, 0)]
        per_s = chunk / cost(e.get("service"), step, model.predict(step))
        out["prefill"] = {"metric": "baton:num_queued_prefill_tokens",
                          "average": int(per_s * slo_ttft_s / 2)}
    e = engine_profile(profile, topology.decode_threads, topology.decode_tp)
    model, best = StepModel.from_json(e["model"]), 0
    for batch in range(1, topology.max_num_seqs + 1):
        step = [(1, context)] * batch
        if cost(e.get("service"), step, model.predict(step)) > slo_itl_s:
            break
        best = batch
    out["decode"] = {"metric": "baton:num_requests_running", "average": best}
    return out
