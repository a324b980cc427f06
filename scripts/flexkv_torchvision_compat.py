"""Lets PyPI's torchvision import beside the CPU build of torch (installed into the venv, with a
.pth line, by scripts/install.sh -- only where `import torchvision` fails without it).

PyPI's torchvision is built for CUDA torch: beside torch's CPU build its native library cannot
load (it needs libtorch_cuda.so). torchvision then skips its native ops, except that
_meta_registrations.py registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
unconditionally, and that fails ("operator torchvision::nms does not exist"), so nothing that
imports torchvision loads -- vLLM and Dynamo import it through transformers' image processors.
This hook defines those two operator schemas just before torchvision is first imported, when its
native library cannot load. They have no kernels: calling them raises; the Python parts that
text models use (transforms) work."""

import importlib.abc
import importlib.util
import sys

_LIB = None  # keeps the definitions alive


def _define_missing_ops() -> None:
    global _LIB
    import glob
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return  # the native ops load: torchvision defines them itself
        except OSError:
            pass
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        _LIB.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _define_missing_ops()
        return None  # the regular finders load it


sys.meta_path.insert(0, _BeforeTorchvision())
