"""megamoe: fused Mixture-of-Experts expert layers (dispatch -> L1 -> SwiGLU -> L2 -> combine) for Hopper,
with FP8 and FP4 (MXFP4, NVFP4) expert weights, as torch.library ops."""
from . import ops  # noqa: F401  (loads the C++ library and registers the fakes)
from .api import fp8_fp4_mega_moe, fp8_mega_moe, moe, pre_dispatch, transform_weights
from .buffer import MegaMoEBuffer, buffer_layout, get_symm_buffer
from .module import MegaMoEConfig, MegaMoEExperts, load_experts_from_safetensors

__all__ = [
    "MegaMoEBuffer", "MegaMoEConfig", "MegaMoEExperts", "buffer_layout", "fp8_fp4_mega_moe", "fp8_mega_moe",
    "get_symm_buffer", "load_experts_from_safetensors", "moe", "pre_dispatch", "transform_weights",
]
__version__ = "0.1.0"
