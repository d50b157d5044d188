"""AmoebaNet-D and AmoebaNet-B (tensorflow/tpu's definition, as sized in the GPipe paper) as one flat layer sequence."""

from zoo.amoebanet.cell import Cell
from zoo.amoebanet.drop_path import set_drop_path_progress
from zoo.amoebanet.genotype import AMOEBANET_B, AMOEBANET_D, CellGenotype, Genotype
from zoo.amoebanet.network import AuxHead, Classifier, Stem, amoebanet_layers, head_indices

__all__ = [
    "AMOEBANET_B",
    "AMOEBANET_D",
    "AuxHead",
    "Cell",
    "CellGenotype",
    "Classifier",
    "Genotype",
    "Stem",
    "amoebanet_layers",
    "head_indices",
    "set_drop_path_progress",
]
