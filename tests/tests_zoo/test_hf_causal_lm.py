"""Hugging Face decoder-only language models as zoo models: the library's own forward, loss, generate and loader are
the oracles.

Nothing downloads: each family's tiny random model is written in the real on-disk format (``zoo.hf.causal_lm_tiny``)
and loaded through ``zoo.load_pretrained(directory)``, the code path of a hub id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.runif import RunIf

import zoo

transformers = pytest.importorskip("transformers")

from zoo.hf.causal_lm_tiny import CAUSAL_FAMILIES, save_tiny_causal_lm, tiny_causal_config  # noqa: E402

TIED = {"qwen2", "gemma", "gemma3_text", "gpt2"}
PER_LAYER_TYPE_ROTARY = ("gemma3_text", "olmo3")  # a rotary table per layer type: sliding and full attention
TEXTS = ["the cat sat on the mat.", "a dog runs in the park.", "hello world, this is a small test."]


@pytest.fixture(scope="module", params=CAUSAL_FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Weights larger than the library's 0.02 default give the random model varied (not constant) greedy outputs.
    return save_tiny_causal_lm(tmp_path_factory.mktemp(request.param), request.param, init_std=0.3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("llama-text"), "llama", TEXTS, init_std=0.3)


def library(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def prompts(vocab: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 9 tokens, the first two left-padded (3 and 1 tokens), and their attention mask."""
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` gives left-padded prompts (the library's forward counts 0, 1, ... otherwise)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def test_layers_form_one_flat_sequence_of_the_library_modules(saved: Path) -> None:
    model = zoo.load_pretrained(saved)
    assert isinstance(model, zoo.PretrainedCausalLM)
    assert isinstance(model.layers, torch.nn.Sequential)
    names = [type(layer).__name__ for layer in model.layers]
    assert names == ["TokenEmbedding", "CausalDecoderLayer", "CausalDecoderLayer", "FinalNorm", "LanguageModelHead"]
    # The decoder layers are the library's own modules (no attention of ours), and so is the rotary table.
    assert type(model.layers[1].layer).__module__.startswith("transformers.models.")
    rotary = model.layers[0].rotary
    assert rotary is None if saved.name.startswith("gpt2") else type(rotary).__module__.startswith("transformers.")
    ours = sum(p.numel() for p in model.parameters())
    assert ours == sum(p.numel() for p in library(saved).parameters())  # tied tensors once
    tied = model.layers[-1].lm_head.weight is model.layers[0].tokens.weight
    assert tied == any(saved.name.startswith(family) for family in TIED)
    assert all(module.training for module in model.modules()), "from_pretrained's eval mode would turn dropout off"


def test_logits_equal_the_library_forward(saved: Path) -> None:
    model = zoo.load_pretrained(saved).eval()
    theirs = library(saved)
    ids, mask = prompts()
    torch.testing.assert_close(model(ids), theirs(ids).logits, atol=1e-4, rtol=0)
    expected = theirs(ids, attention_mask=mask, position_ids=positions(mask)).logits
    real = mask.bool()  # a padding position's own output is not defined the same way: neither reads it
    torch.testing.assert_close(model(ids, mask)[real], expected[real], atol=1e-4, rtol=0)


class _Syncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``bool(t)``, ``t.item()``): each a device sync on CUDA."""

    count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padded", [False, True])
def test_a_forward_builds_each_kind_of_mask_once_and_reads_values_no_more_than_the_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, padded: bool
) -> None:
    # Each decoder layer used to build its own mask: the library's "is anything padded?" check, a host sync on CUDA,
    # ran once per layer and forward (169 syncs a step at M = 4 on an H100, where the library's model makes one).
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    import zoo.hf.causal_lm_layers as layers

    config = tiny_causal_config("qwen2", layers=4)
    config.layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model, theirs = zoo.load_pretrained(tmp_path).load_weights().eval(), library(tmp_path)  # read before counting
    calls: list[str] = []
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        real = getattr(layers, name)  # a spy: the real builder runs
        spy = lambda *args, _real=real, _name=name, **kwargs: calls.append(_name) or _real(*args, **kwargs)  # noqa: E731
        monkeypatch.setattr(layers, name, spy)
        monkeypatch.setattr(qwen2, name, spy)
    ids, mask = prompts()
    mask = mask if padded else torch.ones_like(mask)
    with torch.no_grad(), _Syncs() as ours_syncs:
        logits = model(ids, mask)
    ours, calls[:] = sorted(calls), []
    with torch.no_grad(), _Syncs() as library_syncs:
        expected = theirs(ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert ours == sorted(calls) == ["create_causal_mask", "create_sliding_window_causal_mask"]
    assert 0 < ours_syncs.count <= library_syncs.count  # the library's model checks the padding once per kind
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=0)


def test_greedy_generation_equals_library_generate(saved: Path) -> None:
    model = zoo.load_pretrained(saved)
    ids, mask = prompts()
    ours = model.generate(ids, mask, max_new_tokens=8)
    theirs = library(saved).generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=2
    )
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[:, 9:].flatten().tolist())) > 2, "a degenerate model would prove little"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_sampled_generation_with_a_seed_equals_library_generate(
    llama: Path, temperature: float, top_k: int, top_p: float
) -> None:
    # generate draws from torch's global generator; ours from a generator seeded alike: the same tokens on the CPU.
    model = zoo.load_pretrained(llama)
    ids, mask = prompts(model.hparams["config"]["vocab_size"])
    ours = model.generate(
        ids, mask, max_new_tokens=8, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=3
    )
    torch.manual_seed(3)
    theirs = library(llama).generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=temperature, top_k=top_k or None,
        top_p=top_p, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    assert ours.tolist() == theirs.tolist()
    again = model.generate(ids, mask, max_new_tokens=8, do_sample=True, top_p=top_p, seed=4)
    assert again.tolist() != ours.tolist(), "another seed draws other tokens"


@pytest.mark.parametrize(("balance", "chunks"), [([2, 3], 2), ([1, 2, 2], 3)])
def test_generation_on_the_stages_with_caches_equals_library_generate(
    saved: Path, balance: list[int], chunks: int
) -> None:
    # Each stage keeps the cache of its own layers and rebuilds its masks (sliding windows of 4 in Mistral and Qwen2,
    # left padding): the prompt is read once, then one token per row and round crosses the stages.
    from helpers.decoding import pipelined

    model = zoo.load_pretrained(saved)
    ids, mask = prompts()
    theirs = library(saved).generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=2
    )
    model.layers = pipelined(model.layers, balance, chunks)
    assert model.generate(ids, mask, max_new_tokens=8).tolist() == theirs.tolist()


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_seeded_sampling_on_the_stages_draws_the_whole_models_tokens(llama: Path, chunks: int) -> None:
    # Rows end at different rounds (an end token the first row samples early), so a finished micro-batch's rows are
    # drawn and dropped while the others decode, in the whole batch's order of draws.
    from helpers.decoding import pipelined

    model = zoo.load_pretrained(llama)
    ids, mask = prompts(model.hparams["config"]["vocab_size"])
    settings: dict[str, Any] = {"max_new_tokens": 8, "do_sample": True, "top_k": 8, "temperature": 1.3, "seed": 5}
    first = model.generate(ids, mask, **settings, eos_token_id=())
    end = int(first[0, 10])
    whole = model.generate(ids, mask, **settings, eos_token_id=end)
    lengths = [row.index(end) if end in row else 8 for row in whole[:, 9:].tolist()]
    assert lengths[0] <= 1 < max(lengths), f"rows should end at different rounds: {lengths}"
    torch.manual_seed(5)
    theirs = library(llama).generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=8, temperature=1.3, pad_token_id=0,
        eos_token_id=end,
    )  # fmt: skip
    assert whole.tolist() == theirs.tolist()
    model.layers = pipelined(model.layers, [2, 3], chunks)
    assert model.generate(ids, mask, **settings, eos_token_id=end).tolist() == whole.tolist()


def test_a_right_padded_prompt_is_refused(llama: Path) -> None:
    model = zoo.load_pretrained(llama)
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"pad prompts on the left \(tokenizer.padding_side = 'left'\)"):
        model.generate(ids, mask.flip(1))


def test_the_loss_is_the_library_loss_over_the_learned_tokens(llama: Path) -> None:
    model = zoo.load_pretrained(llama).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    tokenizer.padding_side = "right"
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batch = collator([tokenizer(text) for text in TEXTS])
    assert (batch["labels"] == -100).any(), "padding must be left out"
    expected = library(llama)(**batch).loss
    torch.testing.assert_close(model.training_step(batch, 0), expected, atol=1e-5, rtol=0)
    assert int(model.batch_loss_weight(batch)) == int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("family", PER_LAYER_TYPE_ROTARY)
def test_a_training_step_of_a_model_with_a_rotary_table_per_layer_type_equals_the_library(
    family: str, tmp_path: Path
) -> None:
    # Regression: Gemma 3 loaded, then its first forward raised a TypeError (its rotary module takes the layer type).
    # Each layer now gets its type's table: loss and every gradient are the library's (a layer given the other table,
    # of another base, would differ), on a padded batch longer than the sliding window.
    source = save_tiny_causal_lm(tmp_path / family, family, layers=4, init_std=0.3)
    model, theirs = zoo.load_pretrained(source), transformers.AutoModelForCausalLM.from_pretrained(source)
    ids, mask = prompts()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    model.training_step(batch, 0).backward()
    expected = theirs(**batch, position_ids=positions(mask))
    expected.loss.backward()
    torch.testing.assert_close(model.training_step(batch, 0), expected.loss, atol=1e-5, rtol=0)
    library_parameters = dict(theirs.named_parameters())
    for name, parameter in model.named_parameters():
        expected_grad = library_parameters[model.library_keys[name]].grad
        torch.testing.assert_close(parameter.grad, expected_grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_rotary_table_per_layer_type_is_refused_for_the_families_not_reproduced() -> None:
    from zoo.hf.causal_lm import check_causal_config

    mellum = transformers.AutoConfig.for_model("mellum", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"is a 'mellum' model and its rotary embedding has a table per layer type, "):
        check_causal_config(mellum, "mellum-dir")
    embedding = transformers.Gemma3TextConfig(use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"its config sets \['use_bidirectional_attention'\]"):
        check_causal_config(embedding, "embeddinggemma")


def test_a_sequence_longer_than_gpt2_s_positions_is_refused_before_any_layer_runs(tmp_path: Path) -> None:
    # Regression: 200 tokens into a GPT-2 of 128 positions raised a bare IndexError inside the position embedding, on
    # stage 0 only under the pipeline (gloo's "Connection closed by peer" on the others).
    source = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    model = zoo.load_pretrained(source)
    ids = torch.randint(3, 96, (2, 200))
    ran = []
    model.layers[0].register_forward_pre_hook(lambda *args: ran.append(True))
    message = r"a sequence of 200 tokens exceeds the model's 128 learned positions \(n_positions\); truncate to 128, "
    with pytest.raises(ValueError, match=message + r"e.g. tokenizer\(..., truncation=True, max_length=128\)"):
        model.training_step({"input_ids": ids, "labels": ids}, 0)
    with pytest.raises(ValueError, match=r"a prompt of 120 tokens and max_new_tokens=10 need 129 positions, but the "):
        model.generate(ids[:, :120], max_new_tokens=10)
    assert not ran, "refused before the first layer: under the pipeline, on every stage alike"
    model.generate(ids[:, :120], max_new_tokens=9)  # up to the limit: the last new token takes no position


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("too_long", "ValueError: a sequence of 200 tokens exceeds the model's 128 learned positions"),
        ("not_a_mapping", "TypeError: a PretrainedCausalLM batch is a mapping with 'input_ids'"),
    ],
)
def test_a_refused_batch_gets_the_same_error_on_every_stage(tmp_path: Path, case: str, message: str) -> None:
    # Regression: under the pipeline the too-long GPT-2 batch raised an IndexError on stage 0 and gloo's "Connection
    # closed by peer" on the last stage; the list batch an AttributeError from batch_loss_weight on the last stage.
    from helpers.jobs import run_job

    source = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    run_job("helpers.causal_lm_refusal_job", [str(tmp_path), str(source), case], 2, timeout=500)
    said = [(tmp_path / f"{case}-rank-{rank}.txt").read_text(encoding="utf-8") for rank in range(2)]
    assert all(text.startswith(message) for text in said), said


def test_a_rotary_model_runs_past_max_position_embeddings_as_the_library_does(llama: Path) -> None:
    model = zoo.load_pretrained(llama).eval()
    assert model.hparams["config"]["max_position_embeddings"] == 128
    ids = torch.randint(3, 96, (1, 200))
    torch.testing.assert_close(model(ids), library(llama)(ids).logits, atol=1e-4, rtol=0)


def test_a_batch_that_is_not_a_mapping_gets_the_same_type_error_from_every_hook(llama: Path) -> None:
    # Regression: the strategy calls batch_loss_weight on the last stage first, which raised an AttributeError
    # ('list' object has no attribute 'get') where training_step raised the TypeError that says what a batch is.
    model = zoo.load_pretrained(llama)
    ids = torch.randint(3, 96, (2, 8))
    message = r"a PretrainedCausalLM batch is a mapping with 'input_ids' .* not a list"
    for hook in (model.batch_loss_weight, lambda batch: model.training_step(batch, 0)):
        with pytest.raises(TypeError, match=message):
            hook([ids, torch.ones_like(ids)])


def test_test_step_logs_the_token_mean_as_validation_does(llama: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    model = zoo.load_pretrained(llama)
    ids, mask = prompts()
    loader = DataLoader([{"input_ids": ids, "attention_mask": mask}], batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (tested,) = trainer.test(model, loader, verbose=False)
    (validated,) = trainer.validate(model, loader, verbose=False)
    assert tested["test_loss"] == validated["val_loss"] > 0


def test_the_sample_input_is_one_sequence_of_the_context_and_feeds_the_model_summary(llama: Path) -> None:
    # plan="auto" stopped at setup asking for a sample: the model now has one, which Lightning's model summary (run
    # by a plain fit) reads for the layers' input and output sizes.
    import lightning as L
    from lightning.pytorch.utilities.model_summary import ModelSummary

    model = zoo.load_pretrained(llama)
    assert model.example_input_array.shape == (1, 128)
    assert model.example_input_array.dtype == torch.long
    summary = ModelSummary(model, max_depth=2)
    assert summary.in_sizes[summary.layer_names.index("layers")] == [[1, 128], [1, 128]]  # ids and mask
    assert summary.out_sizes[summary.layer_names.index("layers")] == [1, 128, model.hparams["config"]["vocab_size"]]
    ids, mask = prompts()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    trainer.fit(model, torch.utils.data.DataLoader([{"input_ids": ids, "attention_mask": mask}], batch_size=None))
    config = {**model.hparams["config"], "max_position_embeddings": 32_768}
    with torch.device("meta"):
        meta = zoo.PretrainedCausalLM("unused", config=config, pretrained=False)
    assert meta.example_input_array.shape == (1, 2048)
    assert meta.example_input_array.is_meta


@pytest.mark.usefixtures("loopback_process_group")
def test_plan_auto_plans_a_language_model_without_a_hand_made_sample(llama: Path) -> None:
    import lightning as L

    from lightning_gpipe import GPipeStrategy
    from lightning_gpipe.plan import AutoPlan

    model = zoo.load_pretrained(llama)
    ids, mask = prompts()
    rows = [{"input_ids": row, "attention_mask": m} for row, m in zip(ids, mask, strict=True)]
    trainer = L.Trainer(
        strategy=GPipeStrategy(plan=AutoPlan(memory_per_device="1GB")), accelerator="cpu", devices=1, max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(rows, batch_size=3))
    assert trainer.global_step == 1
    # Set aside while the module is cut (Lightning's summary would run it through one stage), back once gathered.
    assert model.example_input_array is None
    assert trainer.strategy.gather_module() is model
    assert model.example_input_array is not None


def test_export_adapter_loads_into_peft_s_model_of_the_library(saved: Path, tmp_path: Path) -> None:
    # LoRA exported only merged, and peft's state dict of model.layers matched none of the library model's names.
    peft = pytest.importorskip("peft")
    model = zoo.load_pretrained(saved, lora={"r": 4, "lora_alpha": 8})
    with torch.no_grad():  # as if trained: the adapters away from their zero initialization
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    exported = model.export_adapter(tmp_path / "adapter")
    assert sorted(path.name for path in exported.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    theirs = peft.PeftModel.from_pretrained(library(saved), exported).eval()
    ids, _ = prompts()
    with torch.no_grad():
        adapted = model.eval()(ids)
        torch.testing.assert_close(theirs(ids).logits, adapted, atol=1e-4, rtol=0)
        assert not torch.allclose(library(saved)(ids).logits, adapted, atol=1e-3), "the adapters change the model"
    with pytest.raises(ValueError, match=r"export_adapter writes LoRA adapters, and this model has none"):
        zoo.load_pretrained(saved).export_adapter(tmp_path / "none")


def test_the_generation_config_gives_the_end_tokens_and_is_exported(tmp_path: Path) -> None:
    # Llama 3 Instruct ends a turn with one of several tokens, listed in generation_config.json, not in config.json.
    source = save_tiny_causal_lm(tmp_path / "source", "llama", init_std=0.3)
    transformers.GenerationConfig(eos_token_id=[2, 7, 11], pad_token_id=0).save_pretrained(source)
    model = zoo.load_pretrained(source)
    assert model.eos_ids == [2, 7, 11]
    ids, mask = prompts()
    theirs = library(source).generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert model.generate(ids, mask, max_new_tokens=8).tolist() == theirs.tolist()
    exported = model.export_pretrained(tmp_path / "export")
    assert transformers.GenerationConfig.from_pretrained(exported).eos_token_id == [2, 7, 11]


def test_a_directory_without_a_tokenizer_loads_and_exports_without_one(saved: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(saved)
    assert model.tokenizer is None
    exported = model.export_pretrained(tmp_path / "export")
    assert not (exported / "tokenizer.json").exists()


def test_export_pretrained_loads_in_transformers_with_equal_logits(saved: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(saved).load_weights().eval()  # read now: changes to pending weights would be lost
    with torch.no_grad():  # change the weights, so that the export cannot pass by re-reading the source
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    exported = model.export_pretrained(tmp_path / "export")
    ids, _ = prompts()
    torch.testing.assert_close(model(ids), library(exported)(ids).logits, atol=1e-4, rtol=0)


def test_export_writes_the_tokenizer(llama: Path, tmp_path: Path) -> None:
    exported = zoo.load_pretrained(llama).export_pretrained(tmp_path / "export")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    original = transformers.AutoTokenizer.from_pretrained(llama)
    assert tokenizer("the cat")["input_ids"] == original("the cat")["input_ids"]


def test_checkpoint_round_trip_and_meta_build(llama: Path, tmp_path: Path) -> None:
    import lightning as L

    model = zoo.load_pretrained(llama, lr=3e-4)
    with torch.device("meta"):
        meta = zoo.PretrainedCausalLM(str(llama), config=model.hparams["config"], pretrained=False)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    again = zoo.load_pretrained(tmp_path / "model.ckpt")
    assert isinstance(again, zoo.PretrainedCausalLM)
    assert again.hparams["lr"] == 3e-4
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_freeze_backbone_trains_the_norm_and_the_head(saved: Path) -> None:
    model = zoo.load_pretrained(saved, freeze_backbone=True)
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    last = (f"layers.{len(model.layers) - 2}.", f"layers.{len(model.layers) - 1}.")
    assert trained, "the head trains"
    assert all(name.startswith(last) or name.startswith("layers.0.tokens.") for name in trained)
    # A tied embedding is the head's weight: it trains, under both of its names.
    assert any(name.startswith("layers.0.") for name in trained) == any(saved.name.startswith(f) for f in TIED)


def test_lora_trains_the_adapters_only_and_exports_merged(saved: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(saved, lora={"r": 4, "lora_alpha": 8}, lr=1e-2)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained
    assert all("lora_" in name for name in trained)
    ids, _ = prompts()
    batch = {"input_ids": ids, "labels": ids}
    optimizer = model.configure_optimizers()["optimizer"]
    for _ in range(2):  # LoRA's B starts at zero: the second step moves the merged weights
        optimizer.zero_grad()
        model.training_step(batch, 0).backward()
        optimizer.step()
    model.eval()
    exported = model.export_pretrained(tmp_path / "export")
    logits = library(exported)(ids).logits
    torch.testing.assert_close(model(ids), logits, atol=1e-4, rtol=0)
    assert not torch.allclose(logits, library(saved)(ids).logits, atol=1e-4), "the adapters changed the model"


def test_an_unsupported_model_is_refused_naming_its_type_and_the_structure(tmp_path: Path) -> None:
    gemma2 = transformers.Gemma2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, pad_token_id=0,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(gemma2).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"is a 'gemma2' model and its config sets \['final_logit_softcapping'\]; "):
        zoo.load_pretrained(tmp_path / "gemma2")
    bloom = transformers.BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2)
    transformers.AutoModelForCausalLM.from_config(bloom).save_pretrained(tmp_path / "bloom")
    with pytest.raises(ValueError, match=r"is a 'bloom' model made of .*'embed_tokens', 'layers', 'norm' and"):
        zoo.load_pretrained(tmp_path / "bloom")


def test_classification_arguments_are_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match=r"num_classes=10 does not apply to the Hugging Face language model"):
        zoo.load_pretrained(llama, num_classes=10)


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hf_causal_lm.pt`` and ``.ckpt`` of the tiny tied Gemma after two AdamW steps with K = 2, M = 4 (the
    embedding on stage 0, its tied output projection on stage 1), ``hf_causal_lm-1f1b.pt`` under ``schedule="1f1b"``
    and ``hf_causal_lm_lora.pt`` with LoRA adapters, ``hf_causal_lm_packed.pt`` on packed sequences (all run first:
    the fill-drain run's checkpoint is the one read), and the predictions."""
    from helpers.jobs import run_job

    out = tmp_path_factory.mktemp("causal-lm-gpipe")
    save_tiny_causal_lm(out / "hf_causal_lm-source", "gemma", init_std=0.3)
    runs = ["hf_causal_lm:4:1f1b", "hf_causal_lm_lora:4", "hf_causal_lm_packed:2", "hf_causal_lm:4"]
    results = run_job("helpers.zoo_job", [str(out), "2", *runs], 2, timeout=600)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return out


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "schedule"),
    [
        ("hf_causal_lm", "gpipe"),
        ("hf_causal_lm", "1f1b"),
        ("hf_causal_lm_lora", "gpipe"),
        ("hf_causal_lm_packed", "gpipe"),
    ],
)
def test_a_two_stage_fit_equals_the_plain_fit(pipelined_run: Path, tmp_path: Path, name: str, schedule: str) -> None:
    # Rows of 4 to 10 tokens with prompts left out: the micro-batches learn 2 to 8 tokens each, so weighing them by
    # their samples instead of their tokens (batch_loss_weight) would move every weight. With LoRA only the adapters
    # (peft's, inside the library's layers on both stages) train. Packed rows (positions restarting, attention kept
    # within each sequence by the masks stage 0 builds from the positions) train as in the plain fit.
    from helpers.zoo_job import fit

    (tmp_path / "hf_causal_lm-source").symlink_to(pipelined_run / "hf_causal_lm-source")
    plain = fit(name, 2, "auto", 1, tmp_path).state_dict()
    saved = f"{name}.pt" if schedule == "gpipe" else f"{name}-{schedule}.pt"
    pipelined = torch.load(pipelined_run / saved, weights_only=True)
    initial = zoo.load_pretrained(pipelined_run / "hf_causal_lm-source").state_dict()
    assert pipelined.keys() == plain.keys()
    moved = "layers.1.layer.self_attn.q_proj.lora_B.default.weight" if "lora" in name else "layers.0.tokens.weight"
    assert not torch.equal(plain[moved], initial.get(moved, torch.zeros_like(plain[moved])))
    for key, expected in plain.items():
        difference = (pipelined[key].double() - expected.double()).abs().max().item()
        assert difference <= 1e-5, f"{key}: max abs difference {difference:.2e}"


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_export_from_a_two_stage_checkpoint(pipelined_run: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(pipelined_run / "hf_causal_lm.ckpt").eval()
    trained = torch.load(pipelined_run / "hf_causal_lm.pt", weights_only=True)
    assert all(torch.equal(value, trained[key]) for key, value in model.state_dict().items())
    exported = model.export_pretrained(tmp_path / "export")
    ids, _ = prompts()
    torch.testing.assert_close(model(ids), library(exported)(ids).logits, atol=1e-4, rtol=0)


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_generation_in_pipelined_predict_and_validation_steps_equals_transformers_generate(
    pipelined_run: Path, tmp_path: Path
) -> None:
    # predict_step generated these under GPipeStrategy (K = 2, M = 2): every stage kept the cache of its layers for
    # two micro-batches of rows in flight.
    from helpers.zoo_job import GENERATION, prompts

    predictions = torch.load(pipelined_run / "hf_causal_lm-predictions.pt", weights_only=True)
    model = zoo.load_pretrained(pipelined_run / "hf_causal_lm.ckpt")
    batch = prompts()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    theirs = library(model.export_pretrained(tmp_path / "export")).generate(
        ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=2, **GENERATION["greedy"]
    )
    width = predictions["greedy"].shape[1]
    assert width == ids.shape[1] + GENERATION["greedy"]["max_new_tokens"]
    assert predictions["greedy"].tolist() == torch.nn.functional.pad(theirs, (0, width - theirs.shape[1])).tolist()
    # Sampling draws in the whole batch's order: the whole model's tokens, whatever the micro-batches.
    model.hparams["generation"] = GENERATION["sampled"]
    assert predictions["sampled"].tolist() == model.predict_step(batch, 0).tolist()
    assert predictions["sampled"].tolist() != predictions["greedy"].tolist()
    # A validation_step that generates at its first call runs once on the whole batch under the pipeline.
    validation = torch.load(pipelined_run / "hf_causal_lm-validation.pt", weights_only=True)
    expected = model.generate(ids, mask, **GENERATION["sampled"])
    assert [tokens.tolist() for tokens in validation] == [expected.tolist()]


def test_the_planner_plans_a_language_model_from_a_sample_of_token_ids(llama: Path) -> None:
    # The planner feeds the first layer one tensor of the sample shape: input_ids alone, without a mask.
    from lightning_gpipe.plan import plan

    model = zoo.load_pretrained(llama)
    ids = torch.randint(3, 96, (2, 16))
    torch.testing.assert_close(model.layers(ids), model(ids))
    result = plan(model, ids[:1], devices=2, memory_per_device="1GB", batch_size=8, flops_per_second=1e9)
    assert sum(result.balance) == len(model.layers)


def test_a_model_on_the_meta_device_runs_and_plans(llama: Path) -> None:
    # The library's mask helpers read the mask's and the positions' values (is any token padded? packed sequences?),
    # which meta tensors do not have: on meta the layers build the mask as for an unpadded batch.
    from lightning_gpipe.plan import plan

    config = zoo.load_pretrained(llama).hparams["config"]
    with torch.device("meta"):
        model = zoo.PretrainedCausalLM("unused", config=config, pretrained=False)
        ids = torch.zeros(1, 64, dtype=torch.long)
        assert model(ids).shape == (1, 64, config["vocab_size"])
    result = plan(model, ids, devices=2, memory_per_device="1GB", batch_size=8, flops_per_second=1e12)
    assert sum(result.balance) == len(model.layers)


def test_pretrained_weights_load_as_float32_unless_told(tmp_path: Path) -> None:
    # transformers 5 loads a checkpoint in its own dtype: a bfloat16 hub model would train in bfloat16 under
    # Lightning's default precision="32-true" without anyone asking for it.
    source = save_tiny_causal_lm(tmp_path / "source", "llama")
    transformers.AutoModelForCausalLM.from_pretrained(source).to(torch.bfloat16).save_pretrained(source)
    assert {p.dtype for p in zoo.load_pretrained(source).parameters()} == {torch.float32}
    assert {p.dtype for p in zoo.load_pretrained(source, dtype="auto").parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"dtype='int8' is not a floating-point torch dtype; use 'float32'"):
        zoo.load_pretrained(source, dtype="int8")


def test_freeze_backbone_and_lora_are_not_combined(llama: Path) -> None:
    with pytest.raises(ValueError, match=r"freeze_backbone=True and lora=... both choose what trains"):
        zoo.load_pretrained(llama, freeze_backbone=True, lora={"r": 4})
