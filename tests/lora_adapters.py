"""Random PEFT LoRA adapters, made by peft itself (so the files are what users bring),
and transformers + peft's greedy output with them applied, not merged: the reference of
Baton's LoRA tests."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

from baton.services.lora.adapter import TARGETS

ALL = tuple(TARGETS)  # every projection an adapter may target


def save_adapter(model, folder: Path, rank: int, seed: int, targets=ALL,
                 alpha: int | None = None, rslora: bool = False) -> Path:
    """A rank-`rank` adapter of `model` (left untouched) with random A and B, B scaled so
    the adapter moves the output distribution but keeps it a language model's."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5 / rank)
            elif "lora_A" in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    peft_model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def peft_over(model, adapters: dict[str, Path]):
    """peft's PeftModel over `model` with every adapter loaded; `model` is restored after."""
    from peft import PeftModel

    names = list(adapters)
    peft_model = PeftModel.from_pretrained(model, str(adapters[names[0]]),
                                           adapter_name=names[0])
    try:
        for name in names[1:]:
            peft_model.load_adapter(str(adapters[name]), adapter_name=name)
        yield peft_model
    finally:
        peft_model.unload()


def under(peft_model, name: str | None):
    """A context in which `peft_model` runs adapter `name` (None: the base model)."""
    if name is None:
        return peft_model.disable_adapter()
    peft_model.set_adapter(name)
    return contextlib.nullcontext()


def peft_greedy(model, jobs: list[tuple[list[int], str | None]], adapters: dict[str, Path],
                max_new: int) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter name or None), through peft (applied, not
    merged) over `model` with every adapter loaded."""
    import torch

    outs = []
    with peft_over(model, adapters) as peft_model:
        for prompt, name in jobs:
            ids = torch.tensor([prompt])
            with torch.no_grad(), under(peft_model, name):
                out = peft_model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                    pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def peft_forced(model, jobs, adapters: dict) -> list[list[int]]:
    """For each (prompt, adapter name or None, tokens): transformers + peft's greedy choice
    at each of the tokens' positions given the tokens before it, in one forward pass.
    Equal to `tokens` exactly when peft's greedy decoding gives them (peft_greedy's
    answer, without its token-by-token generation: 20x cheaper on the default model)."""
    import torch

    outs = []
    with peft_over(model, adapters) as peft_model:
        for prompt, name, tokens in jobs:
            ids = torch.tensor([prompt + tokens[:-1]])
            with torch.no_grad(), under(peft_model, name):
                logits = peft_model(input_ids=ids).logits
            outs.append(logits[0, len(prompt) - 1:].argmax(-1).tolist())
    return outs
