"""The genotypes of AmoebaNet: which operation each cell applies to which hidden state, as tensorflow/tpu spells them.

A cell starts with two hidden states, 0 (the current input after the cell's 1x1 base) and 1 (the previous-previous
output, resized to match), then runs five combinations: combination ``i`` applies ``operations[2i]`` to state
``inputs[2i]`` and ``operations[2i + 1]`` to state ``inputs[2i + 1]`` and adds the two results, which become state
``i + 2``. The cell's output is the channel concatenation of the states in ``concat``.

tensorflow/tpu (``model_specs.py``) writes the output rule as ``used_hiddenstates`` flags and concatenates every state
whose flag is 0; :meth:`CellGenotype.from_tf` reads that form. Note that state 0 of the normal cells is flagged 0
although two operations read it, so it is concatenated too: that is what reproduces the GPipe paper's parameter counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AMOEBANET_B", "AMOEBANET_D", "CellGenotype", "Genotype"]

NUM_COMBINATIONS = 5


@dataclass(frozen=True)
class CellGenotype:
    """One cell type: ten operations, the hidden state each reads, and the states concatenated into the output."""

    operations: tuple[str, ...]
    inputs: tuple[int, ...]
    concat: tuple[int, ...]

    def __post_init__(self) -> None:
        count = 2 * NUM_COMBINATIONS
        if len(self.operations) != count or len(self.inputs) != count:
            raise ValueError(
                f"a cell genotype needs {count} operations and {count} inputs (two per combination), "
                f"got {len(self.operations)} operations and {len(self.inputs)} inputs"
            )
        for position, state in enumerate(self.inputs):
            # Combination i may read the two cell inputs and the states made by combinations 0..i-1.
            available = 2 + position // 2
            if not 0 <= state < available:
                raise ValueError(
                    f"inputs[{position}]={state}: combination {position // 2} can only read states 0..{available - 1}"
                )
        num_states = 2 + NUM_COMBINATIONS
        if not self.concat or any(not 0 <= state < num_states for state in self.concat):
            raise ValueError(f"concat={self.concat}: name at least one state, each in 0..{num_states - 1}")

    @classmethod
    def from_tf(
        cls, operations: Sequence[str], hiddenstate_indices: Sequence[int], used_hiddenstates: Sequence[int]
    ) -> CellGenotype:
        """Read tensorflow/tpu's form: the output concatenates the states whose ``used_hiddenstates`` flag is 0."""
        if len(used_hiddenstates) != 2 + NUM_COMBINATIONS:
            raise ValueError(
                f"used_hiddenstates has {len(used_hiddenstates)} flags; give one per state ({2 + NUM_COMBINATIONS})"
            )
        concat = tuple(state for state, used in enumerate(used_hiddenstates) if not used)
        return cls(tuple(operations), tuple(hiddenstate_indices), concat)


@dataclass(frozen=True)
class Genotype:
    """An AmoebaNet architecture: its normal cell and its reduction cell (also used by the two stem cells)."""

    name: str
    normal: CellGenotype
    reduction: CellGenotype


AMOEBANET_D = Genotype(
    name="amoebanet_d",
    normal=CellGenotype.from_tf(
        ["1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1", "1x7_7x1", "max_pool_3x3", "none", "avg_pool_3x3", "1x1"],
        [1, 1, 1, 0, 0, 0, 2, 2, 1, 5],
        [0, 1, 1, 0, 0, 1, 0],
    ),
    reduction=CellGenotype.from_tf(
        [
            "max_pool_2x2",
            "max_pool_3x3",
            "none",
            "3x3",
            "1x7_7x1",
            "max_pool_3x3",
            "none",
            "max_pool_2x2",
            "avg_pool_3x3",
            "1x1",
        ],
        [0, 0, 2, 1, 2, 2, 3, 1, 2, 3],
        [1, 1, 1, 1, 0, 0, 0],
    ),
)
"""AmoebaNet-D (tensorflow/tpu ``amoeba_net_d`` or ``evol_net_x``): normal concat [0, 3, 4, 6], reduction [4, 5, 6]."""

AMOEBANET_B = Genotype(
    name="amoebanet_b",
    normal=CellGenotype.from_tf(
        [
            "1x1",
            "max_pool_3x3",
            "none",
            "separable_3x3_2",
            "1x1",
            "separable_3x3_2",
            "1x1",
            "none",
            "avg_pool_3x3",
            "1x1",
        ],
        [1, 1, 1, 0, 1, 0, 2, 2, 1, 5],
        [0, 1, 1, 0, 0, 1, 0],
    ),
    reduction=CellGenotype.from_tf(
        [
            "max_pool_2x2",
            "max_pool_3x3",
            "none",
            "3x3",
            "dil_2_separable_5x5_2",
            "max_pool_3x3",
            "none",
            "separable_3x3_2",
            "avg_pool_3x3",
            "1x1",
        ],
        [0, 0, 2, 1, 2, 2, 3, 1, 4, 3],
        [1, 1, 1, 1, 1, 0, 0],
    ),
)
"""AmoebaNet-B (tensorflow/tpu ``amoeba_net_b`` or ``evol_net_h``): normal concat [0, 3, 4, 6], reduction [5, 6]."""
