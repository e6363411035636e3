"""Codecs of pipecomm.compress against float64 oracles: error bounds, payload sizes, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecomm import compress
from pipecomm.compress import Int8Codec, get_codec, relative_error

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CHUNK = Int8Codec().chunk_size
NUMELS = (0, 1, 2, 3, 7, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 1000, 4099)


def _roundtrip(codec, x):
    payload = codec.encode(x)
    return payload, codec.decode(payload, x.numel(), x.dtype)


def test_get_codec_names():
    assert get_codec(None) is None
    for name in ("fp16", "bf16", "int8"):
        codec = get_codec(name)
        assert codec.name == name
    assert compress.CODECS == ("fp16", "bf16", "int8")


def test_unknown_codec_lists_choices():
    with pytest.raises(ValueError, match=r"fp16.*bf16.*int8"):
        get_codec("fp8")


@pytest.mark.parametrize("name", compress.CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("numel", NUMELS)
def test_payload_nbytes_is_exact(name, dtype, numel):
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    payload, y = _roundtrip(codec, x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.payload_nbytes(numel)
    assert y.dtype == dtype and y.shape == (numel,)


def test_payload_sizes_by_formula():
    assert get_codec("fp16").payload_nbytes(5) == 10
    assert get_codec("bf16").payload_nbytes(0) == 0
    c = Int8Codec(chunk_size=256)
    assert c.payload_nbytes(0) == 0
    assert c.payload_nbytes(1) == 4 + 1
    assert c.payload_nbytes(256) == 4 + 256
    assert c.payload_nbytes(257) == 8 + 257


def test_ratio():
    assert get_codec("fp16").ratio(torch.float32) == 2.0
    assert get_codec("bf16").ratio(torch.float64) == 4.0
    assert get_codec("fp16").ratio(torch.float16) == 1.0
    c = Int8Codec(chunk_size=256)
    n = 256 * 1000
    assert c.ratio(torch.float32) == pytest.approx(4 * n / c.payload_nbytes(n))
    with pytest.raises(TypeError):
        c.ratio(torch.int32)


def _values(n, seed, dtype):
    """Values spread over many binades, all inside half precision's normal range."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(
        torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-4), math.log(6e4), generator=g)
    )
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (mag * sign).to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize(("name", "unit"), (("fp16", 2.0**-11), ("bf16", 2.0**-8)))
def test_16bit_relative_error_per_element(name, unit, dtype):
    x = _values(20_000, 1, dtype)
    _, y = _roundtrip(get_codec(name), x)
    rel = ((y.double() - x.double()).abs() / x.double().abs()).max().item()
    assert rel <= unit * (1 + 1e-6)
    assert rel > unit / 4  # the codec really is lossy at that precision (a test that can fail)


@pytest.mark.parametrize("name", ("fp16", "bf16"))
def test_16bit_input_roundtrips_exactly(name):
    codec = get_codec(name)
    x = _values(1000, 2, codec.wire_dtype)
    payload, y = _roundtrip(codec, x)
    assert torch.equal(y, x)
    payload.zero_()  # the payload is a copy, never a view of the input
    assert torch.equal(y, x) and x.abs().min() > 0


def test_fp16_overflow_and_nonfinite_propagate():
    codec = get_codec("fp16")
    x = torch.tensor([1e5, -1e5, float("inf"), float("nan"), 1.0])
    _, y = _roundtrip(codec, x)
    assert y[0] == math.inf and y[1] == -math.inf and y[2] == math.inf
    assert math.isnan(y[3]) and y[4] == 1.0
    _, yb = _roundtrip(get_codec("bf16"), torch.tensor([1e30, float("-inf"), float("nan")]))
    assert yb[0] == pytest.approx(1e30, rel=2**-8) and yb[1] == -math.inf and math.isnan(yb[2])


def _int8_bound(x64, chunk):
    """Per-element bound max|x over chunk| / 254 (+ float32 round-off), float64 oracle."""
    n = x64.numel()
    nchunks = -(-n // chunk)
    padded = torch.nn.functional.pad(x64.abs(), (0, nchunks * chunk - n)).view(nchunks, chunk)
    cmax = padded.amax(dim=1).repeat_interleave(chunk)[:n]
    return cmax / 254 * (1 + 1e-5) + cmax * 2.0**-22, cmax


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("chunk", (1, 7, 256, 1024))
def test_int8_error_bound_per_element(dtype, chunk):
    g = torch.Generator().manual_seed(chunk)
    n = 3 * chunk + 5
    # chunks of very different scales: each must be quantized with its own scale
    x = (
        torch.randn(n, generator=g, dtype=torch.float64)
        * torch.logspace(-3, 3, n, dtype=torch.float64)
    ).to(dtype)
    codec = Int8Codec(chunk_size=chunk)
    _, y = _roundtrip(codec, x)
    x64 = x.double()
    bound, cmax = _int8_bound(x64, chunk)
    err = (y.double() - x64).abs()
    if dtype in (torch.float16, torch.bfloat16):  # decoding rounds to the output dtype too
        unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
        bound = bound + x64.abs() * unit * 1.01 + cmax * unit / 254
    assert (err <= bound).all(), (err - bound).max()
    # the maximum of every chunk is represented exactly up to float32 round-off
    idx = (
        torch.nn.functional.pad(x64.abs(), (0, -(-n // chunk) * chunk - n))
        .view(-1, chunk)
        .argmax(dim=1)
    )
    first = idx + torch.arange(0, idx.numel() * chunk, chunk)
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(y.double()[first], x64[first], rtol=1e-6, atol=0)


def test_int8_matches_float64_oracle():
    """Element-wise the codec equals round(x / (max/127)) * (max/127) computed in float64."""
    chunk = 16
    x = torch.randn(5 * chunk - 3, generator=torch.Generator().manual_seed(3))
    codec = Int8Codec(chunk_size=chunk)
    _, y = _roundtrip(codec, x)
    x64 = x.double()
    n = x64.numel()
    padded = torch.nn.functional.pad(x64, (0, 5 * chunk - n)).view(5, chunk)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127
    ref = (torch.round(padded / scale) * scale).view(-1)[:n]
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-7)


def test_int8_all_zero_chunks_and_zero_tensor():
    codec = Int8Codec(chunk_size=4)
    x = torch.tensor([0.0, 0, 0, 0, 1, -2, 0, 3, 0, 0])
    _, y = _roundtrip(codec, x)
    torch.testing.assert_close(y, x, rtol=0, atol=3 / 254)
    assert torch.equal(y[:4], torch.zeros(4)) and not y.isnan().any()
    assert relative_error(torch.zeros(10), "int8") == 0.0


def test_int8_nonfinite_chunk_decodes_to_nan_others_untouched():
    codec = Int8Codec(chunk_size=4)
    x = torch.tensor([1.0, 2, 3, 4, 5, float("inf"), 7, 8, 9, float("nan"), 1])
    _, y = _roundtrip(codec, x)
    assert y[4:8].isnan().all() and y[8:].isnan().all()
    torch.testing.assert_close(y[:4], x[:4], rtol=0, atol=4 / 254)


def test_empty_tensors():
    for name in compress.CODECS:
        codec = get_codec(name)
        for dtype in FLOAT_DTYPES:
            payload, y = _roundtrip(codec, torch.empty(0, dtype=dtype))
            assert payload.numel() == 0 and y.numel() == 0 and y.dtype == dtype


def test_decode_to_other_dtype_and_noncontiguous_input():
    x = torch.randn(200, 2, generator=torch.Generator().manual_seed(0))[:, 0]  # strided 1-D view
    assert not x.is_contiguous()
    for name in compress.CODECS:
        codec = get_codec(name)
        y = codec.decode(codec.encode(x), x.numel(), torch.float64)
        assert y.dtype == torch.float64
        assert relative_error(x, name) < 0.01
        torch.testing.assert_close(
            y.float(), codec.decode(codec.encode(x.contiguous()), 200, torch.float32)
        )


@pytest.mark.parametrize("name", compress.CODECS)
def test_decode_from_misaligned_slice_of_a_receive_buffer(name):
    """Payloads concatenated in one buffer may start at odd byte offsets."""
    codec = get_codec(name)
    a, b = torch.randn(13), torch.randn(300)
    pa, pb = codec.encode(a), codec.encode(b)
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), pa, pb])
    ya = codec.decode(buf[1 : 1 + pa.numel()], 13, torch.float32)
    yb = codec.decode(buf[1 + pa.numel() :], 300, torch.float32)
    assert torch.equal(ya, codec.decode(pa, 13, torch.float32))
    assert torch.equal(yb, codec.decode(pb, 300, torch.float32))
    buf.zero_()  # decode's result does not alias the buffer
    assert torch.equal(yb, codec.decode(pb, 300, torch.float32))


@pytest.mark.parametrize("name", compress.CODECS)
@pytest.mark.parametrize(
    "dtype", (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)
)
def test_integer_and_complex_input_rejected(name, dtype):
    with pytest.raises(TypeError, match="floating"):
        get_codec(name).encode(torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("name", compress.CODECS)
def test_bad_arguments(name):
    codec = get_codec(name)
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.zeros(2, 3))
    payload = codec.encode(torch.ones(10))
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(payload, 11, torch.float32)
    with pytest.raises(TypeError, match="uint8"):
        codec.decode(payload.to(torch.int8), 10, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        codec.decode(payload, 10, torch.int32)
    with pytest.raises(ValueError, match="numel"):
        codec.decode(payload, -1, torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        Int8Codec(chunk_size=0)


def test_relative_error_ordering_and_values():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    e16, eb16, e8 = (relative_error(x, n) for n in ("fp16", "bf16", "int8"))
    assert 0 < e16 < 2.0**-11 and 0 < eb16 < 2.0**-8 and 0 < e8 < 1 / 127
    assert e16 < eb16 < e8
    with pytest.raises(ValueError):
        relative_error(x, None)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=0, max_size=600),
    st.sampled_from([1, 3, 64, 256]),
)
def test_int8_property(values, chunk):
    x = torch.tensor(values, dtype=torch.float32)
    codec = Int8Codec(chunk_size=chunk)
    payload, y = _roundtrip(codec, x)
    assert payload.numel() == codec.payload_nbytes(x.numel())
    bound, _ = _int8_bound(x.double(), chunk)
    assert ((y.double() - x.double()).abs() <= bound + 1e-30).all()


def test_encode_is_vectorised_on_large_inputs():
    """No per-chunk Python loop: 4M elements (16k chunks) round-trip well within the timeout."""
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    assert relative_error(x, "int8") < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", compress.CODECS)
def test_cuda_matches_cpu(name):
    codec = get_codec(name)
    x = torch.randn(3 * CHUNK + 5, generator=torch.Generator().manual_seed(0))
    payload = codec.encode(x.cuda())
    assert payload.is_cuda and payload.numel() == codec.payload_nbytes(x.numel())
    y = codec.decode(payload, x.numel(), torch.float32)
    assert y.is_cuda
    torch.testing.assert_close(y.cpu(), codec.decode(codec.encode(x), x.numel(), torch.float32))


# --------------------------------------------------------------------------- error feedback


def test_error_feedback_step_is_the_rule():
    """x = g + e, e' = x - D(C(x)); e_0 = 0 (None); x is updated in place."""
    codec = get_codec("int8")
    g = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    x, e = compress.error_feedback(g.clone(), None, codec)
    assert torch.equal(x, g)
    assert torch.equal(e, g - codec.decode(codec.encode(g), 1000, g.dtype))
    g2 = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    buf = g2.clone()
    x2, e2 = compress.error_feedback(buf, e, codec)
    assert x2 is buf and torch.equal(x2, g2 + e)
    assert torch.equal(e2, x2 - codec.decode(codec.encode(x2), 1000, g.dtype))


def test_error_feedback_state_keeps_one_residual_per_key():
    ef = compress.ErrorFeedback("fp16")
    a, b = torch.full((5,), 1 / 3), torch.full((7,), 1 / 7)
    ef.compensate("a", a.clone())
    ef.compensate("b", b.clone())
    assert set(ef.residuals) == {"a", "b"} and ef.residuals["a"].numel() == 5
    with pytest.raises(ValueError, match="codec"):
        compress.ErrorFeedback(None)


def test_error_feedback_needs_a_compression_and_a_bool():
    assert compress.check_error_feedback(False, None, "X") is False
    with pytest.raises(ValueError, match=r"X: error_feedback=True needs a compression"):
        compress.check_error_feedback(True, None, "X")
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        compress.check_error_feedback(1, "int8", "X")


def test_pipesgd_error_feedback_needs_a_compression():
    from pipecomm.pipesgd import PipeSGD

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"PipeSGD: error_feedback=True.*compression"):
        PipeSGD(model, opt, compression=None, error_feedback=True)
    assert PipeSGD(model, opt, compression="int8", error_feedback=True).error_feedback
