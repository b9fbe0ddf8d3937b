"""Trace schema: round trip, partial loads, and clear errors on bad files."""
import json

import pytest
import torch
from safetensors.torch import save_file

from spin_indexer.traces.schema import (Trace, TraceFormatError, TraceMeta, context_bin, list_traces, load_meta,
                                        load_trace)


def make_trace(steps=4, layers=3, next_n=2, context=150, k=16, seed=0, with_topk=True, accepted=True):
    g = torch.Generator().manual_seed(seed)
    # row j of step s: context + s + (j - next_n + 1) + next_n tokens (the prompt plus s decoded, plus drafts)
    lens = torch.tensor([[context + s + j + 1 for j in range(next_n)] for s in range(steps)], dtype=torch.int32)
    max_len = int(lens.max()) + 3  # some slack: the last columns are -inf everywhere
    scores = torch.randn(steps, layers, next_n, max_len, generator=g).half()
    past = torch.arange(max_len)[None, None, None, :] >= lens[:, None, :, None].long()
    scores = scores.masked_fill(past, float("-inf"))
    topk = None
    if with_topk:
        topk = scores.float().topk(k, dim=-1).indices.to(torch.int32)
    meta = TraceMeta(model="m", indexer="oracle", prompt_id=f"p{seed}", task="synthetic", context_len=context,
                     k=k, next_n=next_n)
    acc = torch.randint(0, next_n, (steps,), generator=g, dtype=torch.int32) if accepted else None
    return Trace(scores, lens, meta, topk, acc)


def test_round_trip_exact(tmp_path):
    t = make_trace()
    path = t.save(tmp_path)
    assert path.name == "p0.safetensors" and (tmp_path / "p0.json").is_file()
    back = load_trace(path)
    assert torch.equal(back.scores, t.scores) and back.scores.dtype == torch.float16
    assert torch.equal(back.seq_lens, t.seq_lens)
    assert torch.equal(back.topk, t.topk)
    assert torch.equal(back.accepted, t.accepted)
    assert back.meta == t.meta
    # the stem and the .json name work too
    assert torch.equal(load_trace(tmp_path / "p0").scores, t.scores)
    assert torch.equal(load_trace(tmp_path / "p0.json").seq_lens, t.seq_lens)
    assert list_traces(tmp_path) == [path]


def test_round_trip_without_optional_parts(tmp_path):
    t = make_trace(next_n=1, with_topk=False, accepted=False)
    back = load_trace(t.save(tmp_path, name="plain"))
    assert back.topk is None and back.accepted is None
    assert torch.equal(back.scores, t.scores)


@pytest.mark.parametrize("layers,steps", [([0, 2], range(1, 3)), (range(1, 3), None), ([2, 0], range(0, 4))])
def test_partial_load_matches_slicing(tmp_path, layers, steps):
    t = make_trace(seed=3)
    back = load_trace(t.save(tmp_path), layers=layers, steps=steps)
    s = slice(None) if steps is None else slice(steps.start, steps.stop)
    assert torch.equal(back.scores, t.scores[s][:, list(layers)])
    assert torch.equal(back.topk, t.topk[s][:, list(layers)])
    assert torch.equal(back.seq_lens, t.seq_lens[s])
    assert torch.equal(back.accepted, t.accepted[s])


def test_unknown_metadata_keys_go_to_extra(tmp_path):
    t = make_trace()
    t.save(tmp_path)
    raw = json.loads((tmp_path / "p0.json").read_text())
    raw["temperature"] = 0.0
    (tmp_path / "p0.json").write_text(json.dumps(raw))
    meta, _ = load_meta(tmp_path / "p0")
    assert meta.extra["temperature"] == 0.0


def _rewrite_meta(tmp_path, **changes):
    raw = json.loads((tmp_path / "p0.json").read_text())
    for key, val in changes.items():
        if val is None:
            raw.pop(key)
        else:
            raw[key] = val
    (tmp_path / "p0.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("changes,match", [
    ({"format_version": 99}, "format_version: expected 1, got 99"),
    ({"k": None}, "missing metadata field.*k"),
    ({"next_n": 3}, "next_n = 3"),
    ({"k": 7}, "topk: expected shape"),
    ({"k": 0}, "k: expected 1 <= k"),
])
def test_bad_metadata(tmp_path, changes, match):
    make_trace().save(tmp_path)
    _rewrite_meta(tmp_path, **changes)
    with pytest.raises(TraceFormatError, match=match) as info:
        load_trace(tmp_path / "p0")
    assert "p0" in str(info.value)  # the message names the file


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(TraceFormatError, match="metadata file not found"):
        load_trace(tmp_path / "nope")
    make_trace().save(tmp_path)
    (tmp_path / "p0.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        load_trace(tmp_path / "p0")
    make_trace().save(tmp_path)
    (tmp_path / "p0.safetensors").write_bytes(b"garbage bytes, not a safetensors header")
    with pytest.raises(TraceFormatError, match="unreadable safetensors"):
        load_trace(tmp_path / "p0")
    make_trace().save(tmp_path)
    (tmp_path / "p0.safetensors").unlink()
    with pytest.raises(TraceFormatError, match="tensor file not found"):
        load_trace(tmp_path / "p0")


def test_bad_tensors(tmp_path):
    t = make_trace()
    t.save(tmp_path)
    base = {"scores": t.scores, "seq_lens": t.seq_lens, "topk": t.topk}

    def write(**over):
        tensors = {**base, **over}
        save_file({k: v for k, v in tensors.items() if v is not None}, str(tmp_path / "p0.safetensors"))

    write(seq_lens=None)
    with pytest.raises(TraceFormatError, match="missing tensor 'seq_lens'"):
        load_trace(tmp_path / "p0")
    write(seq_lens=t.seq_lens.long())
    with pytest.raises(TraceFormatError, match="seq_lens: expected dtype torch.int32"):
        load_trace(tmp_path / "p0")
    write(scores=t.scores.to(torch.bfloat16))
    with pytest.raises(TraceFormatError, match="scores: expected dtype"):
        load_trace(tmp_path / "p0")
    finite = t.scores.clone()
    finite[0, 0, 0, -1] = 1.0  # a value past the row length
    write(scores=finite)
    with pytest.raises(TraceFormatError, match="-inf at and after"):
        load_trace(tmp_path / "p0")
    nan = t.scores.clone()
    nan[1, 2, 0, 0] = float("nan")
    write(scores=nan)
    with pytest.raises(TraceFormatError, match="NaN"):
        load_trace(tmp_path / "p0")
    load_trace(tmp_path / "p0", validate=False)  # data checks are skippable, shape checks are not
    too_long = t.seq_lens.clone()
    too_long[0, 0] = t.max_len + 1
    write(seq_lens=too_long)
    with pytest.raises(TraceFormatError, match="seq_lens: expected lengths in"):
        load_trace(tmp_path / "p0")
    bad_topk = t.topk.clone()
    bad_topk[0, 0, 0, 0] = t.seq_lens[0, 0]
    write(topk=bad_topk)
    with pytest.raises(TraceFormatError, match="topk: expected positions"):
        load_trace(tmp_path / "p0")


def test_constructor_checks_shapes():
    t = make_trace()
    with pytest.raises(TraceFormatError, match=r"seq_lens: expected shape \[S, N\]"):
        Trace(t.scores, t.seq_lens[:2], t.meta)
    with pytest.raises(TraceFormatError, match="accepted: expected shape"):
        Trace(t.scores, t.seq_lens, t.meta, accepted=torch.zeros(2, dtype=torch.int32))


def test_context_bin():
    got = [context_bin(n) for n in (1000, 3900, 4096, 4150, 5700, 5900, 9700, 32768, 0)]
    assert got == ["1K", "4K", "4K", "4K", "4K", "8K", "8K", "32K", "0"]


@pytest.mark.parametrize("layers", [[99], [0, 3], [-1], range(2, 5)])
def test_out_of_range_layers_are_rejected(tmp_path, layers):
    make_trace(layers=3).save(tmp_path)
    with pytest.raises(TraceFormatError, match=r"layers: expected indices in \[0, 3\)") as info:
        load_trace(tmp_path / "p0", layers=layers)
    assert "p0.safetensors" in str(info.value)


def test_layers_must_be_ints(tmp_path):
    make_trace().save(tmp_path)
    with pytest.raises(TypeError, match="layers: expected int"):
        load_trace(tmp_path / "p0", layers=["0"])
    with pytest.raises(TypeError, match="layers: expected a list or range"):
        load_trace(tmp_path / "p0", layers="0,1")


def test_strided_steps_are_rejected(tmp_path):
    make_trace(steps=4).save(tmp_path)
    with pytest.raises(ValueError, match=r"steps: expected a range with step 1.*range\(0, 4, 2\)"):
        load_trace(tmp_path / "p0", steps=range(0, 4, 2))
    with pytest.raises(TypeError, match="steps: expected a range"):
        load_trace(tmp_path / "p0", steps=slice(0, 2))


@pytest.mark.parametrize("steps", [range(4, 6), range(2, 2), range(-1, 2)])
def test_out_of_range_steps_are_rejected(tmp_path, steps):
    make_trace(steps=4).save(tmp_path)
    with pytest.raises(TraceFormatError, match=r"steps: expected a non-empty range starting in \[0, 4\)"):
        load_trace(tmp_path / "p0", steps=steps)


def test_steps_past_the_end_are_clipped(tmp_path):
    t = make_trace(steps=4)
    back = load_trace(t.save(tmp_path), steps=range(1, 100))
    assert back.num_steps == 3 and torch.equal(back.scores, t.scores[1:])
    assert torch.equal(back.accepted, t.accepted[1:])



def test_summary_tensor_is_validated(tmp_path):
    import dataclasses
    from spin_indexer.traces.schema import validate_trace

    t = make_trace(context=60)  # rows of 61-65 tokens: block 1 is past the longest row of steps 0-2
    steps, layers, _, cols = t.scores.shape
    width = -(-cols // 64)
    past = torch.arange(width)[None, :] >= -(-t.seq_lens.long().amax(dim=1)[:, None] // 64)  # [S, W]
    assert past.any() and not past.all()
    good = torch.where(past[:, None, None, :], float("-inf"), torch.randn(steps, layers, 1, width))
    meta = dataclasses.replace(t.meta, extra={"summary_parts": [4]})
    back = load_trace(Trace(t.scores, t.seq_lens, meta, t.topk, t.accepted, good).save(tmp_path))
    assert torch.equal(back.summary, good) and torch.equal(back.summary_of(4), good[:, :, 0])
    assert torch.equal(load_trace(tmp_path / "p0", layers=[2, 0]).summary, good[:, [2, 0]])
    with pytest.raises(ValueError, match="summary_parts = 8"):
        back.summary_of(8)
    with pytest.raises(TraceFormatError, match="extra.summary_parts"):
        Trace(t.scores, t.seq_lens, t.meta, summary=good)  # no extra.summary_parts beside it
    with pytest.raises(TraceFormatError, match="summary: expected the tensor"):
        Trace(t.scores, t.seq_lens, meta)
    with pytest.raises(TraceFormatError, match="summary: expected shape"):
        Trace(t.scores, t.seq_lens, meta, summary=good[..., :-1])
    bad = torch.where(past[:, None, None, :], 1.0, good)
    with pytest.raises(TraceFormatError, match="summary: expected -inf past"):
        validate_trace(Trace(t.scores, t.seq_lens, meta, summary=bad))
    nan = good.clone()
    nan[3, 0, 0, 0] = float("nan")
    with pytest.raises(TraceFormatError, match="NaN"):
        validate_trace(Trace(t.scores, t.seq_lens, meta, summary=nan))
