"""What the client's calls return where a reply mixes tensors and states (tensors as numpy
arrays, or torch tensors when the inputs were torch; states as replayssm.v1 messages)."""

from typing import NamedTuple


class Allocation(NamedTuple):
    slot: int
    matched: int  # tokens of the prefix the slot already holds (from a prefix match)


class PrefillResult(NamedTuple):
    outputs: list  # per layer [N, HV, V] when return_outputs, else empty
    state: object  # SlotState after the prefill


class DecodeResult(NamedTuple):
    outputs: list  # per layer [B, HV, V]
    rows: list  # SlotState per row after the commit (padding rows: slot 0)


class ExportedState(NamedTuple):
    seq_len: int
    tokens: list
    checkpoints: list  # per layer [HV, V, K], numpy (float32 for f32 and bf16 states)
    # Per layer [W-1, C]: the short convolution's last W-1 inputs (a model with conv_width >
    # 0; else empty). Pass them back to import_state with the checkpoints.
    conv_windows: list = []
