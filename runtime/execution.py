"""`Execution`: how the runtime executes a stage's compute, as the plan decides and the cost model prices it.

These choices change how fast a step runs and how much memory it holds, never what it computes
(within the dtype's rounding), so they sit beside the parallel configuration rather than in it:

- compile: each stage's repeated blocks run through torch.compile (regional compilation, static
  shapes per micro-batch), which fuses elementwise work and removes most per-kernel host cost;
- loss: how the last stage computes the loss (LossImpl): "full" materializes the logits and runs
  the loss over them upcast to fp32; "compiled" runs the same loss on the same logits through
  torch.compile, whose fused kernels upcast inside the reduction and write the gradient in the
  logits' dtype, so no fp32 copy of the logits, their log-probabilities or their gradient is held;
  "chunked" computes cross-entropy over chunks of tokens from the last hidden state and the output
  layer's weight, never holding the full logits;
- loss_chunk_tokens: tokens per chunk of the chunked loss (0: the runtime's default);
- vocab_multiple: the output layer's (and its tied embedding's) rows are padded to a multiple of
  this many (1: no padding), so the vocabulary GEMMs run on aligned shapes; logits, the loss,
  metrics and checkpoints keep the real vocabulary. Under tensor parallelism each rank's block of
  the vocabulary is padded to a multiple of it;
- compile_scope: what compile covers (CompileScope): "blocks" (the default; regional compilation, each
  distinct repeated block compiled once, the other layers eager) or "stage" (each stage's whole forward
  one compiled function: every layer fused and dispatched from generated code, at a compile time that
  grows with the stage's depth; a stage's gradients then all come at the end of its compiled backward,
  so a data-parallel gradient sync no longer starts inside it; with the compiled loss the last stage's
  forward and its loss compile as one graph: runtime/losses.compiled_forward_loss);
- compile_backend: torch.compile's backend for compiled stages and the compiled loss (CompileBackend):
  "inductor" (the default; fused kernels) or "aot_eager" (the same graphs captured and differentiated
  ahead of time, run by eager kernels: what tests use where inductor's C++ compilation would take
  minutes).

A plan records them (written only when not the defaults, so earlier plans read unchanged),
codegen writes them into the build's TrainSpec, and planner.evaluate prices the same values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from runtime.documents import Fields


class LossImpl(StrEnum):
    """How the last stage computes a cross-entropy loss."""

    FULL = "full"          # the whole (tokens x vocabulary) logits, the loss over them in fp32
    COMPILED = "compiled"  # the same logits and loss, through torch.compile: no fp32 copy of the logits held
    CHUNKED = "chunked"    # fused: chunks of tokens from the hidden state and the output weight


class CompileBackend(StrEnum):
    """torch.compile's backend for compiled stages."""

    INDUCTOR = "inductor"     # generated fused kernels (Triton on GPU, C++ on CPU)
    AOT_EAGER = "aot_eager"   # dynamo and AOTAutograd's graphs, eager kernels: checks capture, not speed


class CompileScope(StrEnum):
    """What Execution.compile compiles in each stage."""

    BLOCKS = "blocks"   # regional: one compiled function per distinct repeated block, the other layers eager
    STAGE = "stage"     # the stage's whole forward, one compiled function


# The most rows a vocabulary may be padded to a multiple of (far past any device's preference).
MAX_VOCAB_MULTIPLE = 4096


@dataclass(frozen=True)
class Execution:
    """How a stage's compute runs (see module docstring). Defaults: eager, full loss, no padding."""

    compile: bool = False
    loss: str = LossImpl.FULL
    loss_chunk_tokens: int = 0
    vocab_multiple: int = 1
    compile_backend: str = CompileBackend.INDUCTOR
    compile_scope: str = CompileScope.BLOCKS

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"Execution.compile must be true or false, got {self.compile!r}")
        try:
            object.__setattr__(self, "loss", LossImpl(self.loss).value)
        except ValueError:
            raise ValueError(f"Execution.loss {self.loss!r} is not one of {', '.join(LossImpl)}") from None
        if isinstance(self.loss_chunk_tokens, bool) or not isinstance(self.loss_chunk_tokens, int) \
                or self.loss_chunk_tokens < 0:
            raise ValueError(f"Execution.loss_chunk_tokens must be a whole number >= 0 (0: the runtime's default), "
                             f"got {self.loss_chunk_tokens!r}")
        if isinstance(self.vocab_multiple, bool) or not isinstance(self.vocab_multiple, int) \
                or not 1 <= self.vocab_multiple <= MAX_VOCAB_MULTIPLE:
            raise ValueError(f"Execution.vocab_multiple must be a whole number in 1..{MAX_VOCAB_MULTIPLE} "
                             f"(1: no padding), got {self.vocab_multiple!r}")
        try:
            object.__setattr__(self, "compile_backend", CompileBackend(self.compile_backend).value)
        except ValueError:
            raise ValueError(f"Execution.compile_backend {self.compile_backend!r} is not one of "
                             f"{', '.join(CompileBackend)}") from None
        try:
            object.__setattr__(self, "compile_scope", CompileScope(self.compile_scope).value)
        except ValueError:
            raise ValueError(f"Execution.compile_scope {self.compile_scope!r} is not one of "
                             f"{', '.join(CompileScope)}") from None

    @property
    def whole_stage(self) -> bool:
        """Each stage's whole forward runs compiled (compile on, scope "stage")."""
        return self.compile and self.compile_scope == CompileScope.STAGE

    @property
    def compiles(self) -> bool:
        """Something runs through torch.compile: the stages, or the loss."""
        return self.compile or self.compiled_loss

    @property
    def compiled_loss(self) -> bool:
        """The last stage computes the full cross-entropy through torch.compile (runtime/losses.py)."""
        return self.loss == LossImpl.COMPILED

    @property
    def chunked(self) -> bool:
        """The last stage computes a cross-entropy loss fused with the output layer, in chunks."""
        return self.loss == LossImpl.CHUNKED

    def options(self) -> list[str]:
        """The options that differ from the defaults, as codegen's flags name them (for messages)."""
        d = Execution()
        out = []
        if self.compile != d.compile:
            out.append("--compile")
        if self.loss != d.loss:
            out.append(f"--loss-impl {self.loss}")
        if self.loss_chunk_tokens != d.loss_chunk_tokens:
            out.append(f"--loss-chunk-tokens {self.loss_chunk_tokens}")
        if self.vocab_multiple != d.vocab_multiple:
            out.append(f"--vocab-multiple {self.vocab_multiple}")
        if self.compile_scope != d.compile_scope:
            out.append(f"--compile-scope {self.compile_scope}")
        if self.compile_backend != d.compile_backend:
            out.append(f"compile_backend {self.compile_backend}")
        return out

    @property
    def is_default(self) -> bool:
        return self == Execution()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.compile_scope == CompileScope.BLOCKS:   # written only when asked for: documents read as before
            del d["compile_scope"]
        return d

    @classmethod
    def read(cls, f: Fields) -> "Execution":
        """From a document's fields (runtime.documents), every field optional."""
        f.known({}, ("compile", "loss", "loss_chunk_tokens", "vocab_multiple", "compile_backend", "compile_scope"))
        loss = f.choice("loss", LossImpl, LossImpl.FULL.value)
        backend = f.choice("compile_backend", CompileBackend, CompileBackend.INDUCTOR.value)
        scope = f.choice("compile_scope", CompileScope, CompileScope.BLOCKS.value)
        return cls(compile=f.boolean("compile", False), loss=loss,
                   loss_chunk_tokens=f.integer("loss_chunk_tokens", 0, minimum=0),
                   vocab_multiple=f.integer("vocab_multiple", 1, minimum=1, maximum=MAX_VOCAB_MULTIPLE),
                   compile_backend=backend, compile_scope=scope)

    @classmethod
    def from_dict(cls, d: dict, where: str = "execution") -> "Execution":
        return cls.read(Fields(d, where))
