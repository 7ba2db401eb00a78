"""The wire codec: exact round trips, zero-copy frames, and CodecError for malformed input."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from pastry.wire.calls import (
    CallError,
    CopyKv,
    Dist,
    EmbedImg,
    EmbedTxt,
    EngineInfo,
    Forward,
    MaskKv,
    NextDist,
    Sample,
    SwapIn,
    SwapOut,
    ids,
)
from pastry.wire.codec import (
    SUPPORTED_DTYPES,
    VERSION,
    CodecError,
    decode_batch,
    decode_info,
    decode_results,
    encode_batch,
    encode_info,
    encode_results,
)
from pastry.wire.images import ImageLayout


def assert_same(a, b) -> None:
    """Equal type and fields; arrays equal in dtype, shape and values."""
    assert type(a) is type(b)
    if not dataclasses.is_dataclass(a):
        assert a == b
        return
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), f.name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert type(x) is type(y) and x == y, f.name


def assert_all_same(xs, ys) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert_same(x, y)


def wire(frames):
    """What the receiver sees: every frame as bytes (a copy, as off a socket)."""
    return [bytes(memoryview(f).cast("B")) for f in frames]


def roundtrip_batch(calls):
    out = decode_batch(wire(encode_batch(calls)))
    assert_all_same(calls, out)
    return out


ONE_OF_EACH = [
    EmbedTxt(tokens=ids([5, 6, 7]), positions=ids([0, 1, 2]), out_embeds=ids([10, 11, 12])),
    Forward(
        in_embeds=ids([10, 11, 12]),
        ctx_pages=ids([3, 4]),
        ctx_last_len=7,
        out_pages=ids([4, 5]),
        out_offset=7,
        out_embeds=ids([20]),
        out_indices=ids([2]),
        positions=ids([23, 24, 25]),
        mask=np.tri(3, 3 + 23, 23, dtype=bool),
    ),
    NextDist(embed=20, k=16),
    Sample(embed=20, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234),
    CopyKv(src_page=1, dst_page=2, src_offset=3, dst_offset=0, length=5),
    MaskKv(page=4, masked=np.array([True, False] * 8)),
    SwapOut(pages=ids([1, 2]), host_pages=ids([0, 1])),
    SwapIn(host_pages=ids([0, 1]), pages=ids([6, 7])),
    EmbedImg(
        image=np.frombuffer(b"\x89PNG\r\n\x1a\n-bytes", np.uint8),
        positions=ids([3, 4]),
        out_embeds=ids([13, 14]),
    ),
]


def test_every_call_type_roundtrips():
    roundtrip_batch(ONE_OF_EACH)
    for call in ONE_OF_EACH:
        roundtrip_batch([call])
    assert roundtrip_batch([]) == []


def test_defaults_none_and_empty_arrays_roundtrip():
    calls = [
        Forward(in_embeds=ids([1])),  # empty default arrays, positions/mask None
        Forward(in_embeds=ids([])),
        Sample(embed=3),  # seed None, float defaults
        Sample(embed=4, temperature=1, seed=0),  # an int where a float is declared
        EmbedTxt(tokens=ids([]), positions=ids([]), out_embeds=ids([])),
        MaskKv(page=0, masked=np.zeros(0, dtype=bool)),
    ]
    out = roundtrip_batch(calls)
    assert out[0].mask is None and out[0].positions is None and out[2].seed is None
    assert out[0].ctx_pages.dtype == np.int64 and out[0].ctx_pages.shape == (0,)


def test_runs_of_calls_keep_order_and_varying_lengths():
    rng = np.random.default_rng(0)
    calls = []
    for i in range(50):
        n = int(rng.integers(1, 20))
        calls.append(EmbedTxt(ids(rng.integers(0, 100, n)), ids(range(n)), ids(range(i, i + n))))
        calls.append(Forward(in_embeds=ids(range(i, i + n)), ctx_pages=ids(range(i % 7))))
        if i % 3 == 0:
            calls.append(Sample(embed=i, seed=i if i % 2 else None))
            calls.append(Sample(embed=i + 1, temperature=0.5))
    roundtrip_batch(calls)


def test_masks_mixed_with_none_and_other_shapes():
    calls = [
        Forward(in_embeds=ids([0, 1]), mask=np.ones((2, 2), dtype=bool)),
        Forward(in_embeds=ids([2])),
        Forward(in_embeds=ids([3, 4, 5]), mask=np.eye(3, 7, dtype=bool)),
    ]
    out = roundtrip_batch(calls)
    assert out[1].mask is None


def test_all_supported_dtypes_and_mixed_dtypes_in_one_field():
    rng = np.random.default_rng(1)
    for dtype in SUPPORTED_DTYPES:
        arr = (rng.random(12) * 100).astype(dtype).reshape(3, 4)
        roundtrip_batch([SwapOut(pages=arr, host_pages=arr.ravel())])
    # One field, several dtypes across a run (allowed; the engine validates dtypes).
    calls = [
        EmbedTxt(ids([1]), ids([0]), ids([0])),
        EmbedTxt(ids([1]), np.array([5], dtype=np.int32), ids([1])),
    ]
    out = roundtrip_batch(calls)
    assert out[1].positions.dtype == np.int32


def test_non_contiguous_and_zero_dim_arrays():
    base = ids(range(20))
    calls = [
        SwapIn(host_pages=base[::3], pages=base[1::3]),
        SwapIn(host_pages=base[:0], pages=base[::-7]),
    ]
    roundtrip_batch(calls)
    roundtrip_batch([SwapIn(host_pages=np.array(4, dtype=np.int64), pages=ids([1]))])


def test_large_arrays_are_sent_and_received_without_copies():
    tokens = ids(np.arange(1 << 20) % 32000)
    mask = np.tri(2048, 4096, 2048, dtype=bool)
    calls = [
        EmbedTxt(tokens=tokens, positions=ids(range(1 << 20)), out_embeds=tokens),
        Forward(in_embeds=ids(range(2048)), mask=mask),
    ]
    frames = encode_batch(calls)
    assert any(f is mask for f in frames)  # N-D arrays go out as their own buffer
    assert len(frames[0]) < 200  # the header holds no array data
    out = decode_batch(frames)
    assert_all_same(calls, out)
    assert any(np.shares_memory(out[1].mask, f) for f in frames[1:] if f is mask)
    # Single-array runs are concatenated (one copy); decoding is zero-copy views.
    received = wire(frames)
    out = decode_batch(received)
    assert out[0].tokens.base is not None and not out[0].tokens.flags.owndata


def test_unaligned_frames_decode_to_aligned_arrays():
    def unaligned(frame):  # as ZeroMQ hands out small messages: at any offset of a buffer
        raw = bytes(memoryview(frame).cast("B"))
        return memoryview(b"abc" + raw)[3:]

    calls = [EmbedTxt(ids(range(5)), ids(range(5)), ids(range(5)))] * 3
    out = decode_batch([unaligned(f) for f in encode_batch(calls)])
    assert_all_same(calls, out)
    assert all(c.tokens.flags.aligned and c.positions.flags.aligned for c in out)


def test_results_roundtrip():
    results = [
        None,
        None,
        7,
        np.int64(8),  # numpy ints from an engine encode as ints
        Dist(ids=ids([3, 1, 2]), probs=np.array([0.5, 0.3, 0.2], dtype=np.float32)),
        Dist(ids=ids([]), probs=np.zeros(0, dtype=np.float32)),
        CallError("Forward: page 99 is out of range [0, 64)"),
        None,
        2**62,
    ]
    out = decode_results(wire(encode_results(results)))
    expected = [*results[:3], 8, *results[4:]]
    assert_all_same(expected, out)
    assert type(out[3]) is int
    assert decode_results(encode_results([])) == []


def test_many_dists_share_two_frames():
    dists = [
        Dist(ids=ids(range(i, i + 256)), probs=np.full(256, 1 / 256, np.float32))
        for i in range(128)
    ]
    frames = encode_results(dists)
    assert len(frames) == 3
    assert_all_same(dists, decode_results(wire(frames)))


INFO = EngineInfo(
    model_name="tiny-llama",
    arch="llama",
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    max_position=4096,
    dtype="bfloat16",
    device="cpu",
    page_size=16,
    num_pages=128,
    num_embeds=256,
    num_host_pages=0,
    max_batch_tokens=8192,
    traits=("forward", "sample"),
    bos_token_id=None,
    eos_token_ids=(2,),
    tokenizer_json='{"version": "1.0"}' * 1000,
    chat_template="{{ messages }}",
    special_tokens={"bos": "<s>", "eos": "</s>"},
)


def test_info_roundtrip():
    assert decode_info(wire(encode_info(INFO))) == INFO
    plain = dataclasses.replace(INFO, special_tokens={}, chat_template=None, bos_token_id=1)
    assert decode_info(encode_info(plain)) == plain
    vision = dataclasses.replace(INFO, image_layout=ImageLayout(32000, 576))
    assert decode_info(wire(encode_info(vision))) == vision
    tiled = ImageLayout(49190, 64, tile=512, longest_edge=2048, split=True, wrap=49189,
                        whole=49152, cells=tuple(range(36)), row_end=(198,), grid_end=(271,))  # fmt: skip
    back = decode_info(wire(encode_info(dataclasses.replace(INFO, image_layout=tiled))))
    assert back.image_layout == tiled and back.image_token_id == 49190
    assert back.image_layout.positions(1000, 300) == tiled.positions(1000, 300)


# --- encoding errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (SwapOut(pages=np.zeros(2), host_pages=ids([0, 1])), "SwapOut.pages: .*float64"),
        (SwapOut(pages=[1, 2], host_pages=ids([0, 1])), "SwapOut.pages: .*list"),
        (Sample(embed=1, seed=2**70), "cannot encode"),
        (Sample(embed=ids([1])), "Sample.embed: .*ndarray"),
        (MaskKv(page=0, masked=np.zeros(3, dtype=">i8")), "MaskKv.masked"),
    ],
)
def test_encoding_errors_name_the_field(call, match):
    with pytest.raises(CodecError, match=match):
        encode_batch([call])


def test_scalar_field_types_are_checked_by_the_decoder():
    # Scalar fields skip the per-value check when encoding (hot path); the receiver checks.
    with pytest.raises(CodecError, match=r"Sample\.embed: unexpected value type str"):
        decode_batch(encode_batch([Sample(embed="3")]))
    with pytest.raises(CodecError, match=r"Sample\.seed: unexpected value type float"):
        decode_batch(encode_batch([Sample(embed=1, seed=1.5)]))


def test_encoding_rejects_foreign_objects():
    with pytest.raises(CodecError, match="cannot encode a Dist as a call"):
        encode_batch([Sample(1), Dist(ids([1]), np.ones(1, np.float32))])
    with pytest.raises(CodecError, match="cannot encode a Sample as a result"):
        encode_results([Sample(1)])
    with pytest.raises(CodecError, match="cannot encode a bool as a result"):
        encode_results([True])
    with pytest.raises(CodecError, match=r"EngineInfo\.traits"):
        encode_info(dataclasses.replace(INFO, traits=(1, 2)))


# --- malformed input --------------------------------------------------------------------


def edit_header(frames, edit):
    header = msgpack.unpackb(frames[0], use_list=True)
    edit(header)
    return [msgpack.packb(header), *frames[1:]]


BATCH = [
    Forward(in_embeds=ids([1, 2]), ctx_pages=ids([0]), mask=np.ones((2, 2), dtype=bool)),
    Sample(embed=3),
]


def set_at(path, value):
    def edit(h):
        node = h
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (set_at([0], 99), "codec version"),
        (set_at([1], 2), "message kind"),
        (set_at([2], 5), "list of runs"),
        (set_at([2, 0], [2, 1]), "run is"),
        (set_at([2, 0, 0], 42), "unknown tag"),
        (set_at([2, 0, 0], 16), "unknown tag"),  # a result tag inside a batch
        (set_at([2, 0, 0], "Forward"), "unknown tag"),
        (set_at([2, 0, 1], 0), "count must be"),
        (set_at([2, 0, 1], 2), "2 arrays of 2 do not fill 2"),
        (lambda h: h[2][1].__setitem__(1, 2), "Sample.embed: expected 2 items, got 1"),
        (lambda h: h[2][0][2].pop(), "expected 12 fields, got 11"),
        (lambda h: h[2][1][2].append([0, [None]]), "expected 15 fields, got 16"),
        (set_at([2, 0, 2, 0, 0], 7), "unknown column kind"),
        (set_at([2, 0, 2, 0, 1, 0], 9), "unknown dtype code"),
        (set_at([2, 0, 2, 0, 1, 0], 5), "do not fill"),  # float32 over 16 bytes = 4 items, not 2
        (set_at([2, 0, 2, 0, 1, 1], 3), "do not fill"),
        (set_at([2, 0, 2, 0, 1, 1], [-1]), "non-negative"),
        (set_at([2, 0, 2, 0, 1, 1], [1]), "add up to 1"),
        (set_at([2, 0, 2, 0, 1], [3]), "array column is"),
        (set_at([2, 0, 2, 2], [1, [ids([1]).tolist()]]), "does not hold arrays"),
        (set_at([2, 0, 2, 2, 1], ["7"]), "Forward.ctx_last_len: unexpected value type str"),
        (set_at([2, 1, 2, 0, 1], [None]), "Sample.embed: unexpected value type NoneType"),
        (set_at([2, 1, 2, 1, 1], [[1.0]]), "Sample.temperature: unexpected value type"),
        (set_at([2, 0, 2, 8, 1, 0], [0, [2, 3]]), "shape"),
        (set_at([2, 0, 2, 8, 1, 0], [0, [-2, -2]]), "bad array shape"),
        (set_at([2, 0, 2, 8, 1, 0], [0, 4]), "an array is"),
        (set_at([2, 0, 2, 1, 1, 0], 4), "do not fill"),  # float16: 1 int64 = 4 halves
        (set_at([2, 0, 2, 8, 1, 0], None), "left over"),  # mask may be None: frame unused
        (set_at([2, 0, 2, 1], [2, [None]]), "ctx_pages: None is not allowed"),
    ],
)
def test_malformed_batches_raise_codec_error(edit, match):
    frames = encode_batch(BATCH)
    assert_all_same(BATCH, decode_batch(edit_header(frames, lambda h: None)))
    with pytest.raises(CodecError, match=match):
        decode_batch(edit_header(frames, edit))


def test_malformed_frames_raise_codec_error():
    frames = wire(encode_batch(BATCH))
    mask = next(i for i, f in enumerate(frames) if bytes(f) == np.ones((2, 2), bool).tobytes())
    cases = {
        "empty message": [],
        "not valid msgpack": [b"\xc1", *frames[1:]],
        "header must be": [msgpack.packb({"a": 1}), *frames[1:]],
        "missing array frame": frames[:-1],
        "left over": [*frames, b"\x00" * 8],
        "multiple of element size": [frames[0], frames[1][:-3], *frames[2:]],
        "bytes other than 0 and 1": [*frames[:mask], b"\x02" * 4, *frames[mask + 1 :]],
    }
    for match, bad in cases.items():
        with pytest.raises(CodecError, match=match):
            decode_batch(bad)
    with pytest.raises(CodecError, match="message kind"):
        decode_results(frames)
    with pytest.raises(CodecError, match="message kind"):
        decode_info(frames)
    ext = msgpack.packb(
        [VERSION, 1, [[4, 1, [[0, [msgpack.ExtType(1, b"x")]]] + [[0, [None]]] * 14]]]
    )
    with pytest.raises(CodecError, match="unexpected value type ExtType"):
        decode_batch([ext])


def test_malformed_info_raises_codec_error():
    header = msgpack.unpackb(encode_info(INFO)[0], use_list=True)
    for index, value, match in [
        (0, 5, "EngineInfo.model_name"),
        (13, [1], "EngineInfo.traits"),
        (15, ["2"], "EngineInfo.eos_token_ids"),
        (18, {"a": 1}, "EngineInfo.special_tokens"),
    ]:
        bad = [*header[2]]
        bad[index] = value
        with pytest.raises(CodecError, match=match):
            decode_info([msgpack.packb([VERSION, 3, bad])])
    n_fields = len(dataclasses.fields(EngineInfo))
    with pytest.raises(CodecError, match=f"needs {n_fields} fields"):
        decode_info([msgpack.packb([VERSION, 3, header[2][:-1]])])
    with pytest.raises(CodecError, match="1 frame"):
        decode_info([*encode_info(INFO), b""])


def test_random_corruption_never_escapes_codec_error():
    """Flipped, truncated and spliced bytes decode or raise CodecError; nothing else."""
    rng = np.random.default_rng(0)
    good = wire(encode_batch(ONE_OF_EACH + BATCH))
    outcomes = {"ok": 0, "error": 0}
    for _ in range(1500):
        frames = [bytearray(f) for f in good]
        target = frames[0] if rng.random() < 0.8 else frames[rng.integers(len(frames))]
        action = rng.integers(3)
        if action == 0 and len(target):
            for _ in range(rng.integers(1, 4)):
                target[rng.integers(len(target))] = rng.integers(256)
        elif action == 1:
            del target[rng.integers(len(target) + 1) :]
        else:
            frames = frames[: rng.integers(len(frames) + 1)]
        try:
            decode_batch([bytes(f) for f in frames])
            outcomes["ok"] += 1
        except CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 500


def test_default_array_fields_cost_no_frames():
    """A Sample without logit processing carries its empty array fields in the header."""
    plain = [Sample(embed=i, temperature=0.5, seed=i) for i in range(64)]
    frames = encode_batch(plain)
    assert len(frames) == 1
    out = decode_batch(wire(frames))
    assert_all_same(plain, out)
    assert out[0].bias_values.dtype == np.float32 and out[0].penalty_tokens.dtype == np.int64
    processed = [*plain, Sample(embed=1, bias_ids=ids([3]), bias_values=np.ones(1, np.float32))]
    assert_all_same(processed, decode_batch(wire(encode_batch(processed))))
    header = msgpack.unpackb(frames[0])
    header[2][0][2][7] = [3, 99]  # bias_ids: EMPTIES of an unknown dtype
    with pytest.raises(CodecError, match="unknown dtype code"):
        decode_batch([msgpack.packb(header)])
