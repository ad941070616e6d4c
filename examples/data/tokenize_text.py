"""Byte-level tokenizer: a text file -> token files for examples.data.tokens.TokenFile.

    python -m examples.data.tokenize_text IN.txt -o OUT.bin [--val-fraction 0.1] [--dtype uint16]

Token ids are the UTF-8 bytes of the text (vocabulary 256, nothing to download). OUT.bin holds the
first (1 - val_fraction) of the bytes, OUT.val.bin the rest (with --val-fraction > 0); each gets
its .json sidecar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from examples.data.tokens import DTYPES, TokenFileError, write_tokens

VOCAB_SIZE = 256


def val_path(out: str | Path) -> Path:
    """OUT.val.bin for OUT.bin."""
    out = Path(out)
    return out.with_name(out.stem + ".val" + (out.suffix or ".bin"))


def tokenize(text_path: str | Path, out: str | Path, val_fraction: float = 0.0,
             dtype: str = "uint16") -> list[Path]:
    """Write the train (and val) token files of `text_path`'s bytes; the paths written."""
    if not 0 <= val_fraction < 1:
        raise TokenFileError(f"--val-fraction {val_fraction} must be in [0, 1)")
    data = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cut = len(data) - int(len(data) * val_fraction)
    written = [write_tokens(out, data[:cut], dtype, VOCAB_SIZE)]
    if val_fraction > 0:
        written.append(write_tokens(val_path(out), data[cut:], dtype, VOCAB_SIZE))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("text", help="UTF-8 text file")
    ap.add_argument("-o", "--output", required=True, help="train token file (OUT.bin; val goes to OUT.val.bin)")
    ap.add_argument("--val-fraction", type=float, default=0.0, help="tail of the text kept for validation")
    ap.add_argument("--dtype", choices=DTYPES, default="uint16", help="token width on disk")
    args = ap.parse_args(argv)
    if not Path(args.text).is_file():
        print(f"error: text file {args.text} does not exist", file=sys.stderr)
        return 2
    try:
        paths = tokenize(args.text, args.output, args.val_fraction, args.dtype)
    except (TokenFileError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p} ({p.stat().st_size // np.dtype(args.dtype).itemsize} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
