"""Data modules of the zoo: images (CIFAR, Food-101, the embedded shapes) and multilingual text (translation, LM)."""

from zoo.data.cutout import Cutout
from zoo.data.image_transforms import image_transform
from zoo.data.images import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    EmbeddedImageDataModule,
    Food101DataModule,
    ImageDataModule,
    load_image_dataset,
)
from zoo.data.language_model import LanguageModelDataModule
from zoo.data.sampling import TemperatureSampler, temperature_probabilities
from zoo.data.synthetic_images import load_embedded_dataset, make_embedded_dataset
from zoo.data.synthetic_text import make_synthetic_corpus
from zoo.data.tokenizer import SubwordTokenizer
from zoo.data.translation import TranslationDataModule

__all__ = [
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "Cutout",
    "EmbeddedImageDataModule",
    "Food101DataModule",
    "ImageDataModule",
    "LanguageModelDataModule",
    "SubwordTokenizer",
    "TemperatureSampler",
    "TranslationDataModule",
    "image_transform",
    "load_embedded_dataset",
    "load_image_dataset",
    "make_embedded_dataset",
    "make_synthetic_corpus",
    "temperature_probabilities",
]
