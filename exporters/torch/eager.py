"""`eager`: the production torch model itself, fp32 or bf16; streamed from its checkpoint and run layer
by layer where it does not fit in memory whole (exporters/torch/streamed.py)."""

from __future__ import annotations

import torch

from exporters.torch.candidate import (DTYPES, TorchCandidate, device_availability, device_info, device_of,
                                        device_option)
from exporters.torch.streamed import StreamedTorchCandidate, build_streamed
from oracle.backend import Backend
from oracle.reference.streaming import forced_mode
from oracle.schedule import LAYER_BY_LAYER


class EagerBackend(Backend):
    """`transform(model)` may modify the built model in place: how faults are injected."""

    precisions = tuple(DTYPES)
    option_schema = (device_option("the production model"),)
    # the production model in its precision, plus one layer's tensors as read (fresh, 10% slack);
    # measured peaks: full-size OLMoE (6.92 B) bf16 15.2 GiB, OLMoE --layers 2 (1.05 B) bf16 3.8 GiB
    # (device=cuda: built on the host, then moved)
    memory_per_param = {"fp32": 4.4, "bf16": 2.4}
    memory_note = "the production model in memory"

    def __init__(self, name: str = "eager", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        return True, ""

    def availability_for(self, spec):
        return device_availability(self, spec)

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults/) injected into the production model."""
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id)

    def streams(self, src, spec) -> bool:
        """The production model is streamed from the checkpoint (build_streamed) where it would
        not fit in memory whole (its memory_per_param estimate over what is available);
        $MOE_ORACLE_REFERENCE=whole|streamed forces one (as it does for HF's)."""
        from oracle.backend import BASE_MEMORY, available_memory

        if forced_mode() is not None:
            return forced_mode() == "streamed"
        avail = available_memory()
        return avail is not None and super().memory_estimate(src, spec)[0] + BASE_MEMORY > avail

    def memory_estimate(self, src, spec):
        """Whole: memory_per_param. Streamed (where the whole would not fit): as the streamed reference, whose
        bound covers the production model's layers beside it (oracle.reference.streaming.streamed_memory)."""
        from oracle.reference.streaming import streamed_memory

        if spec.precision not in self.memory_per_param or not self.streams(src, spec):
            return super().memory_estimate(src, spec)
        return streamed_memory(src)

    def load(self, model, spec):
        device = device_of(spec)
        if self.streams(model, spec):
            return self._load_streamed(model, spec, device)
        m = model.build_production(DTYPES[spec.precision])
        if self.transform is not None:
            self.transform(m)
        info = device_info({"executor": f"torch {torch.__version__} eager"}, device)
        return TorchCandidate(m.to(device), DTYPES[spec.precision], info, device)

    def _load_streamed(self, src, spec, device):
        from oracle.backend import InputError

        if device != "cpu":
            raise InputError(f"--option device={device}: this checkpoint is streamed from disk (the production model "
                             "would not fit in memory whole); the model on the GPU needs it in memory")
        if self.transform is not None:
            raise InputError(f"{self.name}: a seeded fault needs the production model in memory (this checkpoint is "
                             "streamed from disk)")
        info = {"executor": f"torch {torch.__version__} eager (decoder layers read from the checkpoint's shards for "
                            "each use)",
                "schedule": LAYER_BY_LAYER}
        return StreamedTorchCandidate(build_streamed(src, DTYPES[spec.precision]), DTYPES[spec.precision], info)


BACKEND = EagerBackend()
