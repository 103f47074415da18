"""Text generation from a checkpoint of any layout, on one process: deterministic for a seed, greedy at top_k=1,
never outside the top k, the vocabulary from the checkpoint, clear errors for bad inputs, and ``generate.py``."""

from __future__ import annotations

import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.app.generation import generate, generate_from_checkpoint, generate_ids, load_for_generation
from lightning_mp_lstm.checkpoint import CheckpointError, consolidate, is_sharded
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.data.vocab import Vocabulary
from tests.helpers import parameters_of, quiet_trainer, run_command, run_ranks

SIZES = {"embedding_dim": 16, "hidden_size": 16, "num_layers": 2}


def _data() -> LMDataModule:
    data = LMDataModule(source="synthetic", batch_size=16, buckets=[8, 16, 32, 60],
                        synthetic={"num_train": 160, "num_valid": 16, "num_test": 16, "vocab_size": 40,
                                   "num_classes": 4})
    data.setup("fit")
    return data


def _fit(strategy, devices: int, steps: int = 6):
    warnings.filterwarnings("ignore")
    data = _data()
    torch.manual_seed(0)
    model = LSTMLanguageModel(data.vocab_size, optimizer="adam", lr=0.01, **SIZES)
    trainer = quiet_trainer(strategy, devices, max_steps=steps, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    return trainer, model, data


def _sharded_worker(rank: int, world_size: int, directory: str) -> dict:
    strategy = MPLSTMStrategy(checkpoint_format="sharded", report_after_steps=None, timeout=60)
    trainer, model, _ = _fit(strategy, world_size, steps=3)
    trainer.save_checkpoint(Path(directory) / "sharded.ckpt")
    return parameters_of(model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, LSTMLanguageModel, Vocabulary]:
    """A checkpoint written by Lightning's default strategy, and the model and vocabulary it loads as."""
    path = tmp_path_factory.mktemp("generate") / "default.ckpt"
    trainer, _, _ = _fit("auto", 1)
    trainer.save_checkpoint(path)
    model, vocab = load_for_generation(path)
    return path, model, vocab


@pytest.fixture(scope="module")
def lively(trained) -> tuple[LSTMLanguageModel, Vocabulary]:
    """A model whose next token depends strongly on the context (large random weights; a few training steps
    leave a tiny model close to a unigram model), with the trained checkpoint's vocabulary."""
    _, _, vocab = trained
    torch.manual_seed(1)
    return LSTMLanguageModel(len(vocab), init_range=1.0, **SIZES).eval(), vocab


def _greedy(model: LSTMLanguageModel, vocab: Vocabulary, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with a full forward pass over the whole sequence at every step (no carried state)."""
    sequence, out = [vocab.eos_id, *prompt_ids], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([sequence]))[0][0, -1]
            logits[vocab.pad_id] = -math.inf
            out.append(int(logits.argmax()))
            sequence.append(out[-1])
            if out[-1] == vocab.eos_id:
                break
    return out


def _ranks(model: LSTMLanguageModel, vocab: Vocabulary, prompt_ids: list[int], sample: list[int]) -> list[int]:
    """For every generated token: how many tokens the model found more likely at that step (padding excluded)."""
    with torch.no_grad():
        logits = model(torch.tensor([[vocab.eos_id, *prompt_ids, *sample]]))[0][0]
    ranks = []
    for t, token in enumerate(sample):
        row = logits[len(prompt_ids) + t].clone()  # the position whose next token is sample[t]
        row[vocab.pad_id] = -math.inf
        ranks.append(int((row > row[token] + 1e-5).sum()))
    return ranks


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(trained):
    _, model, vocab = trained
    settings = {"prompt": "w1 w2", "num_samples": 5, "max_tokens": 20, "temperature": 0.8, "top_k": 10}
    first = generate(model, vocab, seed=0, **settings)
    assert len(first) == 5 and all(s.startswith("w1 w2") for s in first)
    assert generate(model, vocab, seed=0, **settings) == first
    assert generate(model, vocab, seed=1, **settings) != first
    assert len(set(first)) > 1  # the samples of one call differ from each other
    # Sample i does not depend on how many samples are drawn.
    assert generate(model, vocab, seed=0, **{**settings, "num_samples": 2}) == first[:2]
    # It runs in eval mode and leaves the model's mode as it found it.
    model.train()
    try:
        assert generate(model, vocab, seed=0, **settings) == first and model.training
    finally:
        model.eval()


@pytest.mark.parametrize("prompt", ["", "w1 w2 w3"])
def test_top_k_1_is_greedy_decoding_with_the_full_forward_pass(lively, prompt):
    model, vocab = lively
    prompt_ids, samples = generate_ids(model, vocab, prompt, num_samples=3, max_tokens=15, temperature=2.5,
                                       top_k=1, seed=4)
    assert prompt_ids == vocab.encode(prompt.split())
    expected = _greedy(model, vocab, prompt_ids, 15)
    assert samples == [expected] * 3


def test_top_k_never_samples_outside_the_k_most_likely_tokens(lively):
    model, vocab = lively
    settings = {"prompt": "w5", "num_samples": 8, "max_tokens": 20, "temperature": 3.0, "seed": 0}
    prompt_ids, samples = generate_ids(model, vocab, top_k=3, **settings)
    ranks = [r for sample in samples for r in _ranks(model, vocab, prompt_ids, sample)]
    assert max(ranks) < 3 and len(set(ranks)) == 3  # all of the top 3 drawn, nothing else
    _, unlimited = generate_ids(model, vocab, top_k=None, **settings)
    assert max(r for sample in unlimited for r in _ranks(model, vocab, prompt_ids, sample)) >= 3


def test_a_sample_ends_at_eos_or_after_max_tokens_and_never_holds_padding(trained):
    _, model, vocab = trained
    _, samples = generate_ids(model, vocab, "", num_samples=20, max_tokens=6, temperature=1.5, top_k=None, seed=2)
    assert any(len(s) < 6 for s in samples) and any(len(s) == 6 for s in samples)
    for sample in samples:
        assert 1 <= len(sample) <= 6 and vocab.pad_id not in sample
        assert vocab.eos_id not in sample[:-1]
        assert len(sample) == 6 or sample[-1] == vocab.eos_id
    texts = generate(model, vocab, "", num_samples=20, max_tokens=6, temperature=1.5, top_k=None, seed=2)
    assert texts == [" ".join(vocab.decode([i for i in s if i != vocab.eos_id])) for s in samples]


def test_unknown_prompt_words_warn_and_are_read_as_unk(trained):
    _, model, vocab = trained
    with pytest.warns(UserWarning, match=r"not in the vocabulary, read as <unk>: zzz, qqq$"):
        prompt_ids, _ = generate_ids(model, vocab, "w1 zzz qqq zzz", max_tokens=3)
    assert prompt_ids == [vocab.encode(["w1"])[0], vocab.unk_id, vocab.unk_id, vocab.unk_id]
    with pytest.warns(UserWarning, match="zzz"):
        text = generate(model, vocab, "w1 zzz", max_tokens=3, top_k=1)[0]
    assert text.startswith("w1 <unk>")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, vocab, "w1 w2", max_tokens=3)  # known words: no warning


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("temperature", 0.0, "temperature must be a finite number > 0, got 0.0"),
    ("temperature", -1.0, "temperature must be a finite number > 0, got -1.0"),
    ("temperature", float("nan"), "temperature must be a finite number > 0, got nan"),
    ("top_k", 0, r"top_k must be an integer >= 1 \(1 is greedy decoding\) or None \(no limit\), got 0"),
    ("top_k", -5, "top_k must be an integer >= 1 .* got -5"),
    ("top_k", 2.5, "top_k must be an integer >= 1 .* got 2.5"),
    ("num_samples", 0, r"num_samples must be a positive integer, got 0"),
    ("max_tokens", 0, r"max_tokens must be a positive integer, got 0"),
    ("seed", "x", "seed must be an integer, got 'x'"),
    ("prompt", "w1 <pad>", "the prompt contains the padding token <pad>"),
])
def test_bad_settings_fail_with_a_message_naming_the_value(trained, setting, value, message):
    path, model, vocab = trained
    with pytest.raises(ValueError, match=message):
        generate(model, vocab, **{setting: value})
    if setting != "prompt":  # checked before the checkpoint is read
        with pytest.raises(ValueError, match=message):
            generate_from_checkpoint(path.with_name("absent.ckpt"), **{setting: value})


def test_bad_checkpoints_fail_with_a_clear_message(trained, tmp_path):
    path, _, _ = trained
    with pytest.raises(FileNotFoundError, match="absent.ckpt does not exist"):
        load_for_generation(tmp_path / "absent.ckpt")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="truncated.ckpt .* cannot be read: it is truncated"):
        load_for_generation(truncated)
    checkpoint = torch.load(path, weights_only=False)
    without_vocab = tmp_path / "without_vocab.ckpt"
    torch.save({k: v for k, v in checkpoint.items() if k != "LMDataModule"}, without_vocab)
    with pytest.raises(CheckpointError, match=r"without_vocab.ckpt holds no vocabulary: .* 'LMDataModule'"):
        load_for_generation(without_vocab)
    without_hparams = tmp_path / "without_hparams.ckpt"
    torch.save({k: v for k, v in checkpoint.items() if k != "hyper_parameters"}, without_hparams)
    with pytest.raises(CheckpointError, match="holds no model hyperparameters"):
        load_for_generation(without_hparams)
    other_vocab = tmp_path / "other_vocab.ckpt"
    torch.save({**checkpoint, "LMDataModule": {"vocab": Vocabulary(["<pad>", "<unk>", "<eos>", "a"]).state_dict()}},
               other_vocab)
    with pytest.raises(CheckpointError, match="the vocabulary has 4 words but the model's vocab_size is 43"):
        load_for_generation(other_vocab)
    with pytest.raises(CheckpointError, match="is a directory but not a sharded checkpoint"):
        load_for_generation(tmp_path)


@pytest.mark.processes
def test_checkpoints_of_lightning_default_and_mp_lstm_strategies_load_strictly(trained, tmp_path):
    path, model, vocab = trained
    saved = torch.load(path, weights_only=False)
    assert vocab.tokens == saved["LMDataModule"]["vocab"]["tokens"] and len(vocab) == 43
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["state_dict"][name]), name
    trainer, mp_model, _ = _fit(MPLSTMStrategy(report_after_steps=None), 1)
    try:
        trainer.save_checkpoint(tmp_path / "mp_lstm.ckpt")
    finally:
        trainer.strategy.shutdown()
    loaded, loaded_vocab = load_for_generation(tmp_path / "mp_lstm.ckpt", device="cpu")
    assert loaded_vocab == vocab and not loaded.training
    reference = parameters_of(mp_model)
    assert {n: p for n, p in loaded.named_parameters()}.keys() == reference.keys()
    for name, value in loaded.named_parameters():
        assert torch.equal(value, reference[name]), name


def test_a_tied_weight_saved_under_its_first_name_loads(trained, tmp_path):
    _, _, vocab = trained
    torch.manual_seed(0)
    tied = LSTMLanguageModel(len(vocab), embedding_dim=8, hidden_size=8, tie_weights=True)
    state = {k: v for k, v in tied.state_dict().items() if k != "decoder.weight"}
    torch.save({"state_dict": state, "hyper_parameters": dict(tied.hparams),
                "LMDataModule": {"vocab": vocab.state_dict()}}, tmp_path / "tied.ckpt")
    model, _ = load_for_generation(tmp_path / "tied.ckpt")
    assert model.decoder.weight is model.embedding.weight
    assert torch.equal(model.embedding.weight, state["embedding.weight"])


@pytest.mark.timeout(150)
@pytest.mark.processes
def test_a_sharded_pp2_checkpoint_loads_on_one_process_without_a_process_group(trained, tmp_path):
    _, _, vocab = trained
    per_rank = run_ranks(_sharded_worker, 2, str(tmp_path), timeout=120)
    directory = tmp_path / "sharded.ckpt"
    assert is_sharded(directory) and len(list(directory.glob("*.distcp"))) == 2
    assert per_rank[0].keys().isdisjoint(per_rank[1].keys())  # each rank held its own blocks only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, loaded_vocab = load_for_generation(directory)
    assert not [w for w in caught if "torch.distributed" in str(w.message)]  # the one-process read is intended
    assert not (dist.is_available() and dist.is_initialized())
    assert loaded_vocab == vocab
    reference = {**per_rank[0], **per_rank[1]}
    assert dict(model.named_parameters()).keys() == reference.keys()
    for name, value in model.named_parameters():
        assert torch.equal(value, reference[name]), name
    consolidate(directory, tmp_path / "one.ckpt")
    settings = {"prompt": "w3", "num_samples": 3, "max_tokens": 12, "temperature": 0.8, "top_k": 5, "seed": 7}
    from_directory = generate_from_checkpoint(directory, **settings)
    assert from_directory == generate_from_checkpoint(tmp_path / "one.ckpt", **settings)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_generate_py_prints_the_samples_and_fails_cleanly_on_bad_input(trained):
    path, model, vocab = trained
    command = [sys.executable, "generate.py", f"ckpt_path={path}", "prompt=w1 zzz", "num_samples=3", "max_tokens=8",
               "temperature=0.8", "top_k=5", "seed=3"]
    result = run_command(command, timeout=100)
    assert result.returncode == 0, result.stdout[-4000:]
    with pytest.warns(UserWarning):
        expected = generate(model, vocab, "w1 zzz", num_samples=3, max_tokens=8, temperature=0.8, top_k=5, seed=3)
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("w1 <unk>")] == expected, result.stdout[-4000:]
    assert "generate.py: warning: prompt words not in the vocabulary, read as <unk>: zzz" in lines
    result = run_command([sys.executable, "generate.py", f"ckpt_path={path}", "temperature=0", "top_k=0"], timeout=100)
    assert result.returncode == 1
    assert re.fullmatch(r"generate\.py: temperature must be a finite number > 0, got 0 .*\n", result.stdout)
