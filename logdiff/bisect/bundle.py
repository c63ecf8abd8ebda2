"""Offline bundles: one side's capture points written to disk, so that two sides can be bisected later, on
CPU, with no model and no engine present (`logdiff capture`, `logdiff bisect --bundle A --bundle B`).

A bundle is a folder of two files (docs/bundle-format.md is the specification):

- `tensors.safetensors`: for each capture point NAME (logdiff.bisect.capture.point_names) a tensor `NAME`
  [R, ...], its rows first, and `NAME:rows` int64 [R, 2], the (sequence, position) each row holds;
- `manifest.json`: format and version, the side, the model (name, dtype, transformers config), the
  sequences (prompt + response token ids, prompt length, temperature), each point's dtype, and provenance.

`logprob` holds, for each row whose next token is scored, that token's log-prob: the side's output.
Anything a reader cannot trust is refused with one line (UserError), never compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from logdiff.bisect.capture import Recorder
from logdiff.bisect.locate import Bisection, Captured, locate_first_point
from logdiff.config import ModelConfig
from logdiff.errors import UserError
from logdiff.metrics import compare
from logdiff.report import readable_by_all

FORMAT, VERSION = "logdiff-bundle", 1
MANIFEST, TENSORS = "manifest.json", "tensors.safetensors"
ROWS = ":rows"  # suffix of a point's (sequence, position) index
REQUIRED_POINTS = ("tokens", "positions", "logprob")  # the inputs every forward has, and the output compared
HOW_TO_WRITE = "write it with `logdiff capture` or as docs/bundle-format.md says"


class WorkloadRecorder:
    """A capture that keeps every row of every request: bisect's own Recorder once per request, so a bundle
    keeps rows exactly as a live bisect does."""

    def __init__(self, requests: int):
        self.recorders = [Recorder(i, upto=sys.maxsize) for i in range(requests)]

    def locate(self, request: torch.Tensor, position: torch.Tensor, head: torch.Tensor | None = None) -> None:
        for recorder in self.recorders:
            recorder.locate(request, position, head)

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        for recorder in self.recorders:
            recorder(name, tensor)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each point's rows, by sequence then position, and its `:rows` index, as the bundle stores them."""
        names = dict.fromkeys(name for recorder in self.recorders for name in recorder.rows)  # capture order
        out = {}
        for name in names:
            rows = [(i, p) for i, r in enumerate(self.recorders) for p in sorted(r.rows.get(name, {}))]
            out[name] = torch.stack([self.recorders[i].rows[name][p] for i, p in rows])
            out[name + ROWS] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
        return out


def manifest(side: str, stack: str, model: str, dtype: str, config: ModelConfig, sequences: list[list[int]],
             prompt_lens: list[int], temperatures: list[float], tensors: dict[str, torch.Tensor], provenance: dict) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "side": side, "stack": stack,
        "model": {"name": model, "dtype": dtype, "config": config.to_hf_dict()},
        "sequences": [{"tokens": list(s), "prompt_len": n, "temperature": t}
                      for s, n, t in zip(sequences, prompt_lens, temperatures)],
        "points": {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items() if not name.endswith(ROWS)},
        "provenance": provenance,
    }


def check_target(path: str | os.PathLike) -> Path:
    """A bundle may replace a bundle, nothing else."""
    path = Path(path)
    if path.exists() and not (path / MANIFEST).is_file():
        raise UserError(f"{path} exists and is not a bundle; choose another --out")
    return path


def write_bundle(path: str | os.PathLike, manifest_: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Writes the bundle into a fresh folder beside `path`, then renames it there: a reader never sees half a
    bundle, and an older bundle at `path` is replaced whole. Returns the bytes written."""
    from safetensors.torch import save_file

    path = check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / TENSORS))
        (tmp / MANIFEST).write_text(json.dumps(manifest_, indent=1) + "\n")
        for made, mode in ((tmp, 0o777), (tmp / TENSORS, 0o666), (tmp / MANIFEST, 0o666)):
            readable_by_all(made, mode)  # mkdtemp creates 0700; bundles are for everyone to read
        if path.exists():
            old = path.rename(tmp.with_name(tmp.name + ".old"))
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(f.stat().st_size for f in path.iterdir())


@dataclass
class Bundle:
    path: Path
    side: str
    stack: str
    model: dict
    config: ModelConfig
    sequences: list[list[int]]
    prompt_lens: list[int]
    points: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (rows of the point, their (sequence, position))
    provenance: dict

    def logprobs(self) -> list[torch.Tensor]:
        """Each sequence's response-token log-probs, from the `logprob` rows that score them."""
        found = self.rows_of("logprob")
        out = []
        for s, (tokens, n) in enumerate(zip(self.sequences, self.prompt_lens)):
            missing = [p for p in range(n - 1, len(tokens) - 1) if (s, p) not in found]
            if missing:
                raise UserError(f"bundle {self.path}: point logprob lacks sequence {s} position {missing[0]} (it scores "
                                f"token {missing[0] + 1}); an incomplete bundle is not compared, capture every scored row")
            out.append(torch.stack([found[s, p] for p in range(n - 1, len(tokens) - 1)]).reshape(-1))
        return out

    def rows_of(self, name: str) -> dict[tuple[int, int], torch.Tensor]:
        data, rows = self.points[name]
        return {(s, p): data[i] for i, (s, p) in enumerate(rows.tolist())}

    def recorder(self, sequence: int, upto: int) -> Recorder:
        """A Recorder holding this bundle's rows of `sequence` at positions <= `upto`, as a live capture would."""
        recorder = Recorder(sequence, upto)
        for name in self.points:
            for (s, p), row in self.rows_of(name).items():
                if s == sequence and p <= upto:
                    recorder.rows[name][p] = row
        return recorder


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Reads and checks one bundle; anything missing or inconsistent is one line naming it and the fix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"bundle {path} is not a folder; {HOW_TO_WRITE}")
    for name in (MANIFEST, TENSORS):
        if not (path / name).is_file():
            raise UserError(f"bundle {path} has no {name}; {HOW_TO_WRITE}")
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"bundle {path}: {MANIFEST} is not JSON ({e}); {HOW_TO_WRITE}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"bundle {path}: {MANIFEST} does not say \"format\": \"{FORMAT}\"; {HOW_TO_WRITE}")
    if m.get("version") != VERSION:
        raise UserError(f"bundle {path} is format version {m.get('version')!r}; this logdiff reads version {VERSION}: "
                        "capture it again with this logdiff")
    for key, kind in (("side", str), ("model", dict), ("sequences", list), ("points", dict)):
        if not isinstance(m.get(key), kind):
            raise UserError(f"bundle {path}: {MANIFEST} lacks {key!r} (a JSON {kind.__name__.replace('dict', 'object')}); "
                            f"{HOW_TO_WRITE}")
    try:
        config = ModelConfig.from_hf_dict(m["model"].get("config") or {}, m["model"].get("name", str(path)))
    except UserError as e:
        raise UserError(f"bundle {path}: {e}") from None
    sequences, prompt_lens = _sequences(path, m["sequences"])
    try:
        tensors = load_file(str(path / TENSORS))
    except (SafetensorError, OSError) as e:
        raise UserError(f"bundle {path}: {TENSORS} cannot be read ({e}); capture it again") from None
    points = {}
    for name in [*REQUIRED_POINTS, *(n for n in m["points"] if n not in REQUIRED_POINTS)]:
        missing = [f"{MANIFEST}'s points" * (name not in m["points"]), f"{TENSORS}'s {name!r}" * (name not in tensors),
                   f"{TENSORS}'s {name + ROWS!r}" * (name + ROWS not in tensors)]
        if any(missing):
            fix = HOW_TO_WRITE if name in REQUIRED_POINTS else "capture it, or leave it out of the manifest's points"
            raise UserError(f"bundle {path}: missing capture point {name} (not in {', '.join(filter(None, missing))}); {fix}")
        points[name] = _checked_point(path, name, tensors[name], tensors[name + ROWS], m["points"][name], sequences)
    return Bundle(path, m["side"], m.get("stack", "?"), m["model"], config, sequences, prompt_lens, points,
                  m.get("provenance", {}))


def _sequences(path: Path, entries: list) -> tuple[list[list[int]], list[int]]:
    """Each sequence's token ids and prompt length, checked: a prompt of at least one token and a response."""
    sequences, prompt_lens = [], []
    for i, entry in enumerate(entries):
        tokens = entry.get("tokens") if isinstance(entry, dict) else None
        prompt_len = entry.get("prompt_len") if isinstance(entry, dict) else None
        if (not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) or not isinstance(prompt_len, int)
                or not 1 <= prompt_len < len(tokens)):
            raise UserError(f"bundle {path}: {MANIFEST}'s sequence {i} needs \"tokens\" (prompt + response ids) and "
                            "\"prompt_len\" (at least 1, less than the tokens); " + HOW_TO_WRITE)
        sequences.append(tokens)
        prompt_lens.append(prompt_len)
    return sequences, prompt_lens


def _checked_point(path: Path, name: str, data: torch.Tensor, rows: torch.Tensor, dtype: str,
                   sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    stored = str(data.dtype).removeprefix("torch.")
    if stored != dtype:
        raise UserError(f"bundle {path}: point {name} is {stored} in {TENSORS} but {dtype} in {MANIFEST}; "
                        "write the manifest from the tensors saved")
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 2 or rows.shape[0] != data.shape[0]:
        raise UserError(f"bundle {path}: {name}{ROWS} is {tuple(rows.shape)} {rows.dtype} for {data.shape[0]} rows; "
                        f"it must be int64 [{data.shape[0]}, 2]: (sequence, position) per row")
    seen = set()
    for s, p in rows.tolist():
        if not (0 <= s < len(sequences) and 0 <= p < len(sequences[s])):
            raise UserError(f"bundle {path}: point {name} has a row at sequence {s} position {p}, outside the manifest's "
                            f"{len(sequences)} sequences; index rows by (sequence, position) of the manifest's tokens")
        if (s, p) in seen:
            raise UserError(f"bundle {path}: point {name} holds sequence {s} position {p} twice; keep one row per position")
        seen.add((s, p))
    if data.is_floating_point() and data.isnan().any():
        s, p = rows[data.isnan().flatten(1).any(1).nonzero()[0, 0]].tolist()
        raise UserError(f"bundle {path}: point {name} holds NaN at sequence {s} position {p}; capture only valid rows "
                        "(no padding) of a forward that computed")
    return data, rows


def compare_bundles(a: Bundle, b: Bundle) -> Bisection:
    """Where bundle `a`'s side and bundle `b`'s part ways, reported as live bisect reports it (a as `rollout`)."""
    # The configs as logdiff reads them (a transformers config.json carries many more keys), names aside.
    shapes = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "name"
              and getattr(a.config, f.name) != getattr(b.config, f.name)]
    if shapes:
        raise UserError(f"bundles {a.path} and {b.path} are of different models ({', '.join(shapes)} differ); "
                        "capture both sides on one model")
    if a.model.get("dtype") != b.model.get("dtype"):
        raise UserError(f"bundles {a.path} and {b.path} are of different dtypes ({a.model.get('dtype')} vs "
                        f"{b.model.get('dtype')}); capture both sides in one dtype")
    if len(a.sequences) != len(b.sequences):
        raise UserError(f"bundles {a.path} and {b.path} hold {len(a.sequences)} and {len(b.sequences)} sequences; "
                        "capture both sides on the same sequences")
    for s, (x, y, nx, ny) in enumerate(zip(a.sequences, b.sequences, a.prompt_lens, b.prompt_lens)):
        if x != y or nx != ny:
            at = next((p for p, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            raise UserError(f"bundles {a.path} and {b.path} hold different tokens in sequence {s} (first at position {at}, "
                            f"prompt lengths {nx} and {ny}); the trainer side must score the rollout's tokens")
    for name in set(a.points) & set(b.points):
        (x, _), (y, _) = a.points[name], b.points[name]
        if x.dtype != y.dtype or x.shape[1:] != y.shape[1:]:
            raise UserError(f"bundles {a.path} and {b.path} differ in point {name}'s rows: {_row_type(x)} vs {_row_type(y)}; "
                            "capture both in the model's layout and dtype (cast, reshape to [rows, ...]) before saving")
    config = a.config
    labels = (a.side, b.side) if a.side != b.side else (f"{a.side} {a.path}", f"{b.side} {b.path}")
    first, second = a.logprobs(), b.logprobs()
    comparison = compare(first, second)
    lines = len(a.sequences)
    result = Bisection(
        a.stack if a.stack == b.stack else f"{a.stack} vs {b.stack}",
        f"bundles {a.path} and {b.path}, {a.model.get('name')} {a.model.get('dtype')}, "
        f"{lines} sequence{'s' * (lines != 1)}",
        comparison, logdiff=[(x.float() - y.float()).abs().tolist() for x, y in zip(first, second)],
        divergence=comparison.first_divergence, num_layers=config.num_hidden_layers, sides=labels,
        captured="compared from the bundles: each side's log-probs are its bundle's logprob rows",
    )
    if result.divergence is None:
        return result
    d = result.divergence
    result.position = a.prompt_lens[d.seq] + d.pos - 1
    rows = [Captured(label, bundle.recorder(d.seq, result.position), config) for label, bundle in zip(labels, (a, b))]
    return locate_first_point(result, *rows, config)


def _row_type(t: torch.Tensor) -> str:
    return f"{list(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}"
