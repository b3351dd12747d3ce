"""A reasoning model's thinking kept apart from its answer, by format (vLLM's
`--reasoning-parser` names), torch- and gRPC-free.

    deepseek_r1  DeepSeek-R1: the chat template opens `<think>\\n` itself, so the output
                 starts inside the reasoning: everything before `</think>` is reasoning
                 (a `<think>` the model writes anyway is dropped); no `</think>` at all
                 means the output was all reasoning.
    qwen3        Qwen3: the model opens `<think>` itself; with `enable_thinking: false` the
                 template closes an empty one in the prompt and the output has none. An
                 output that does not start with `<think>` is all answer.

Whitespace around the reasoning (the newlines after `<think>` and around `</think>`) is
dropped, whole or streamed alike, so a stream's deltas join to what `parse` gives.
"""

from __future__ import annotations

from .json_stream import WS


class ReasoningParser:
    """Built per choice. `feed` each text delta, then `finish`, for (reasoning delta,
    content delta) pairs; or `parse` a whole text."""

    start_marker = "<think>"
    end_marker = "</think>"  # the engine starts a structured-output grammar after it
    starts_in_reasoning = False  # the template has already opened the reasoning

    def __init__(self) -> None:
        self._state = "start"  # start (undecided), reasoning, content
        self._pending = ""
        self._ws = ""  # reasoning's trailing whitespace, held: the end marker may follow
        self._lead = True  # at the start of the reasoning or the content: drop whitespace

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is (or may still be) inside the reasoning."""
        return self._state != "content"

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def parse(self, text: str) -> tuple[str | None, str]:
        whole = type(self)()
        r1, c1 = whole.feed(text)
        r2, c2 = whole.finish()
        return (r1 + r2) or None, c1 + c2

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        if self._state == "start":
            self._start(final)
        if self._state == "reasoning":
            self._reasoning(reasoning, final)
        if self._state == "content":
            text = self._pending
            if self._lead:
                text = text.lstrip(WS)
                self._lead = not text
            content.append(text)
            self._pending = ""
        return "".join(reasoning), "".join(content)

    def _start(self, final: bool) -> None:
        """Decides, from the output's first characters, whether it opens with reasoning."""
        text = self._pending.lstrip(WS)
        if text.startswith(self.start_marker):
            self._pending = text[len(self.start_marker):]
            self._state = "reasoning"
        elif (not text or self.start_marker.startswith(text)) and not final:
            return  # may still become the start marker
        elif self.starts_in_reasoning:
            self._pending = text
            self._state = "reasoning"
        else:
            self._state, self._lead = "content", False  # all answer, kept as written

    def _reasoning(self, out: list[str], final: bool) -> None:
        text = self._pending
        if self._lead:
            text = text.lstrip(WS)
            self._lead = not text
        i = text.find(self.end_marker)
        if i >= 0:
            out.append((self._ws + text[:i]).rstrip(WS))
            self._ws = ""
            self._pending = text[i + len(self.end_marker):]
            self._state, self._lead = "content", True
            return
        marker = self.end_marker
        hold = 0 if final else max((k for k in range(1, len(marker))
                                    if text.endswith(marker[:k])), default=0)
        seg = self._ws + text[:len(text) - hold]
        core = seg.rstrip(WS)
        out.append(core)
        self._ws = "" if final else seg[len(core):]  # at the end, trailing space is dropped
        self._pending = text[len(text) - hold:]


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
