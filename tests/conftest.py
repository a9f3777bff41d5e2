"""Test setup: the real ComfyUI on CPU, the pack importable as `qwen_turbo`, tiny models.

ComfyUI is found through COMFYUI_PATH, an ancestor folder, or ~/comfy/ComfyUI; without it
the run stops with an error, so that a green run always means the integration tests ran.
"""

import os

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter. It must be set before any
# kernel module is imported, since @triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.harness.comfyui import COMFY, HOW_TO_PROVIDE, ROOT, ComfyServer, setup_comfy

if COMFY is None:
    raise pytest.UsageError(HOW_TO_PROVIDE)
setup_comfy(cpu=True)  # in-process ComfyUI, CPU only, as `main.py --cpu` would set it up

KERNEL_TESTS = ROOT / "tests" / "kernels"


def pytest_collection_modifyitems(items):
    """Tests under tests/kernels are host_independent (they test the pack's kernels against
    their references), except those marked `host`, which compare with ComfyUI's own code.
    .ci/run runs host_independent tests on its first host only: -m "not host_independent or
    host" on the others."""
    for item in items:
        if KERNEL_TESTS in item.path.parents:
            item.add_marker(pytest.mark.host_independent)


@pytest.fixture(scope="session")
def qwen_vae():
    """ComfyUI's VAE object for the random full-width Qwen-Image VAE."""
    from tests.harness.models import load_vae, qwen_vae_file

    return load_vae(qwen_vae_file())


@pytest.fixture(scope="session")
def sd_vae():
    """ComfyUI's VAE object for a random full-width SD AutoencoderKL."""
    from tests.harness.models import sd_vae

    return sd_vae()


@pytest.fixture(scope="module")
def narrow_sd():
    """The state dict of the narrow 2-block DiT (4 heads of 32, text width 64)."""
    from safetensors.torch import load_file

    from tests.harness.models import qwen_dit_narrow_file

    return load_file(str(qwen_dit_narrow_file()))


@pytest.fixture(scope="module")
def narrow_loaded():
    """The narrow DiT as a plain ModelPatcher (tests/harness/models.py: load_narrow_dit)."""
    from tests.harness.models import load_narrow_dit

    return load_narrow_dit()


@pytest.fixture(scope="module")
def narrow_dit(narrow_loaded):
    """Loader → ModelSamplingAuraFlow, as in the bundled workflows."""
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    return ModelSamplingAuraFlow().patch_aura(narrow_loaded, 3.1)[0]


@pytest.fixture
def sent(monkeypatch):
    """The data the pack's nodes send to their frontend badges, in order."""
    from qwen_turbo.nodes import report

    out = []
    monkeypatch.setattr(report, "send", lambda node_id, data: out.append(data))
    return out


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    from tests.harness.models import models_tree

    return models_tree(tmp_path_factory.mktemp("models"))


@pytest.fixture
def diffusion_models(models_dir, monkeypatch):
    """folder_paths' diffusion_models pointed at the test models tree (this test only)."""
    import folder_paths

    root = models_dir / "diffusion_models"
    monkeypatch.setitem(
        folder_paths.folder_names_and_paths, "diffusion_models", ([str(root)], {".safetensors"})
    )
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    return root


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory, models_dir):
    server = ComfyServer(COMFY, tmp_path_factory.mktemp("comfy_base"), models_dir)
    server.start()
    yield server
    server.stop()
