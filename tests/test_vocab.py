"""The shared vocabularies (pipecomm.vocab) and that every module uses them, not a copy."""

from __future__ import annotations

import pytest

from pipecomm import vocab


def test_vocabularies() -> None:
    assert vocab.ALGORITHMS == ("lp", "mst", "be", "ring", "torch")
    assert vocab.ALGORITHMS[-1] == "torch"  # collectives.api relies on "torch" being last
    assert set(vocab.MODELLED_ALGORITHMS) == set(vocab.ALGORITHMS) - {"torch"}
    assert set(vocab.COMPRESSING_ALGORITHMS) <= set(vocab.ALGORITHMS)
    assert vocab.DEFAULT_ALGORITHM == "auto" and vocab.DEFAULT_ALGORITHM in vocab.ALGORITHM_CHOICES
    assert vocab.CODECS == ("fp16", "bf16", "int8")
    assert vocab.COMPRESSIONS == (None, "fp16", "bf16", "int8")
    assert vocab.MODES == ("sync", "layerwise", "pipe")
    assert set(vocab.MODES) <= set(vocab.TIMING_MODES)


def test_checks_accept() -> None:
    for a in vocab.ALGORITHMS:
        assert vocab.check_algorithm(a) == a
    assert vocab.check_algorithm("be", allowed=vocab.MODELLED_ALGORITHMS) == "be"
    assert vocab.check_compression(None, algorithm="mst") is None
    for c in vocab.CODECS:
        assert vocab.check_compression(c, algorithm="lp") == c
        assert vocab.check_compression(c) == c
    assert vocab.check_mode("delayed", allowed=vocab.TIMING_MODES) == "delayed"


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: vocab.check_algorithm("nccl"), "algorithm must be one of"),
        (lambda: vocab.check_algorithm(None), "algorithm"),
        (lambda: vocab.check_algorithm("torch", allowed=vocab.MODELLED_ALGORITHMS), "algorithm"),
        (lambda: vocab.check_algorithm("x", name="algo", where="f"), "f: algo must be"),
        (lambda: vocab.check_compression("fp8"), "compression must be one of"),
        (lambda: vocab.check_compression("None"), "compression"),
        (lambda: vocab.check_compression("int8", algorithm="mst"), "compression='int8' needs"),
        (lambda: vocab.check_mode("pipes"), "mode must be one of"),
        (lambda: vocab.check_mode("nocomm"), "mode"),
    ],
)
def test_checks_reject(call, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        call()


def test_modules_share_the_vocabulary() -> None:
    from pipecomm import collectives, compress, pipesgd
    from pipecomm.lab.experiments import e05_bsp_sgd
    from pipecomm.lab.networks import cost
    from pipecomm.lab.training import pipesgd_config
    from pipecomm.lab.training import pipesgd_timing_model as timing_model

    assert collectives.ALGORITHMS is vocab.ALGORITHMS
    assert collectives.COMPRESSIONS is vocab.CODECS
    assert cost.ALGORITHMS is vocab.MODELLED_ALGORITHMS
    assert e05_bsp_sgd.ALGORITHMS is vocab.MODELLED_ALGORITHMS
    assert compress.CODECS is vocab.CODECS
    assert pipesgd_config.COMPRESSIONS is vocab.CODECS
    assert timing_model.CODECS is vocab.CODECS
    assert timing_model.MODES is vocab.TIMING_MODES
    assert pipesgd.MODES is vocab.MODES
    assert pipesgd.COMPRESSIONS is vocab.COMPRESSIONS


def test_every_entry_point_defaults_to_auto() -> None:
    import inspect

    from pipecomm import backend, collectives, hooks
    from pipecomm.decentralized import DecentralizedDataParallel
    from pipecomm.pipesgd import PipeSGD

    entry_points = (collectives.allreduce, collectives.broadcast, collectives.reduce,
                    backend.new_group, backend.Options, hooks.CollectiveState,
                    hooks.PipelinedState, hooks.GossipState, PipeSGD, DecentralizedDataParallel)
    for fn in entry_points:
        default = inspect.signature(fn).parameters["algorithm"].default
        assert default == vocab.AUTO, f"{fn.__qualname__}: algorithm={default!r}"
    assert backend.options_from_env({}).algorithm == vocab.AUTO
