"""Which code the graph policy takes for the pack's own (issue 61): the pack's modules, whatever
name ComfyUI imports the pack by, never any other module named under that name: the tests
(`qwen_turbo.tests.…` in a clone at `custom_nodes/qwen_turbo`) or a user's."""

import types

import pytest

from qwen_turbo.cli import comfy_home
from qwen_turbo.kernels import warmup
from qwen_turbo.nodes import report
from qwen_turbo.runtime.dit import attention
from qwen_turbo.runtime.graphs import policy
from qwen_turbo.runtime.graphs.policy import PACK, foreign_code, foreign_object_patch, own


def _code_in(name: str):
    """A wrapper function and a callable object defined in a module named `name` (no file)."""
    module = types.ModuleType(name)

    def wrapper(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    wrapper.__module__ = name
    module.wrapper = wrapper
    module.Hook = type("Hook", (), {"__module__": name, "__call__": wrapper})
    return module.wrapper, module.Hook()


@pytest.mark.parametrize(
    "name",
    [
        f"{PACK}.tests.x",  # the tests' stand-ins, in a clone named as the README says
        f"{PACK}.user_thing",
        f"{PACK}_extras.x",
        f"{PACK}.runtime_extras.x",  # a folder name that only starts like the pack's
        f"{PACK}.nodesx",
    ],
)
def test_code_named_under_the_pack_is_foreign(name):
    wrapper, hook = _code_in(name)
    assert not own(wrapper) and not own(hook)
    options = {"wrappers": {"apply_model": {"someone": [wrapper]}}}
    reason = "'someone' apply_model wrapper runs Python per step"
    assert foreign_code(options, "predict_noise", []) == reason  # inside a whole step's graph
    options = {"wrappers": {}, "optimized_attention_override": hook}
    assert foreign_code(options, "apply_model", []).startswith("transformer option")
    assert foreign_object_patch({"diffusion_model.forward": hook}) is not None


def test_this_test_module_is_foreign():
    """Whatever the clone's folder is named, code in the tests is not the pack's."""

    def stand_in(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    assert not own(stand_in)


def test_the_packs_own_code_is_own():
    """Its runtime, kernels, nodes and cli modules, and the package itself."""
    override = attention.attention_override("sdpa")  # a callable object from runtime/
    top, _ = _code_in(PACK)
    for fn in (policy.own, override, warmup.kernel, report.send, comfy_home.find_comfyui, top):
        assert own(fn), fn
    options = {"wrappers": {}, "optimized_attention_override": override}
    assert foreign_code(options, "apply_model", []) is None
