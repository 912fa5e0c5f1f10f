"""`qerl eval` checks what it can before it loads a model (the model and adapter, each benchmark's data,
the baseline, the output folder), and `qerl eval --dry-run` runs exactly these checks, saying what each
found, and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli as run


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks must answer before the engine (the model) or the tokenizer loads."""
    import qerl_cli.evaluation.run as run_module

    monkeypatch.setattr(run_module, "build_engine", lambda *a, **k: pytest.fail("model loaded before checks"))
    monkeypatch.setattr(run_module, "load_eval_tokenizer", lambda *a: pytest.fail("tokenizer loaded first"))


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_dry_run_lists_the_checks_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, adapter: Path
) -> None:
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    out_dir = tmp_path / "e"
    rc, out, err = run(
        capsys, "eval", str(tiny_model_dir), "--adapter", str(adapter), "--engine", "hf",
        "--benchmarks", "synthetic-addition,gsm8k", "--data-file", f"gsm8k={data}", "-o", str(out_dir),
        "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    assert yaml.safe_load(out)["model"] == str(tiny_model_dir)  # the YAML stays reusable on stdout
    assert "checked, nothing loaded or written:" in err
    assert "--engine: hf -> hf" in err and f"MODEL: {tiny_model_dir}: a model folder" in err
    assert f"--adapter: {adapter}: a PEFT adapter folder" in err
    assert "benchmark synthetic-addition: a synthetic task's held-out split, generated here" in err
    assert f"benchmark gsm8k: the local file {data}" in err
    assert f"--output: {out_dir}: a new folder (made when the run starts)" in err
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "no-adapter"], "--adapter no-adapter: no such folder"),
        (["--benchmarks", "synthetic-nope"], "unknown synthetic task 'synthetic-nope'; choose one of"),
        (
            ["--benchmarks", "gsm8k", "--data-file", "gsm8k=missing.jsonl"],
            "--data-file gsm8k: missing.jsonl: no such",
        ),
        (["--benchmarks", "math500"], "benchmark math500 comes from the Hugging Face Hub"),
        (  # a file of other fields: read before the model loads, not after
            ["--benchmarks", "gsm8k", "--data-file", "gsm8k=other-fields.jsonl"],
            "--data-file gsm8k=PATH with gsm8k's field names",
        ),
        (
            ["--baseline", "nowhere.json"],
            "nowhere.json not found: give the results.json of an earlier `qerl eval`",
        ),
        (["-o", "a-file"], "--output a-file is a file, not a folder: give another path or move the file"),
        (  # found only once the model had loaded
            ["--set", "template=plian"],
            "template=plian is not a prompt template (did you mean plain?): choose one of qerl, boxed, plain",
        ),
    ],
)
def test_a_bad_input_exits_2_naming_it_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch, no_model_load,
    args: list[str], message: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("qerl_cli.data.datasets._in_local_cache", lambda hub_id: False)  # an empty cache
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "other-fields.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    before = sorted(tmp_path.iterdir())
    for dry in ([], ["--dry-run"]):
        argv = [
            "eval",
            str(tiny_model_dir),
            "--engine",
            "hf",
            "--benchmarks",
            "synthetic-addition",
            *args,
            *dry,
        ]
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and message in err, err
    assert sorted(tmp_path.iterdir()) == before  # no eval_results/ made


def test_a_missing_model_and_an_unusable_engine_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch, no_model_load, hide_packages
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, "eval", "./no-such-model", "--benchmarks", "synthetic-addition", "--dry-run")
    assert rc == 2 and "model ./no-such-model: no such folder" in err
    hide_packages("vllm")
    rc, _, err = run(
        capsys, "eval", "m", "--engine", "vllm", "--benchmarks", "synthetic-addition", "--dry-run"
    )
    assert rc == 2 and "--engine vllm: vLLM is not installed" in err and "--engine hf" in err
    assert list(tmp_path.iterdir()) == []


def test_a_rescore_checks_its_samples_and_writes_back_there(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saved = tmp_path / "saved"
    saved.mkdir()
    rc, _, err = run(capsys, "eval", "--rescore", str(saved), "--dry-run")
    assert rc == 2 and f"{saved} holds no samples_<benchmark>.jsonl files to rescore" in err
    (saved / "samples_gsm8k.jsonl").write_text("")
    rc, _, err = run(capsys, "eval", "--rescore", str(saved), "--dry-run")
    assert rc == 0, err
    assert f"--rescore: {saved}: samples of gsm8k" in err
    assert f"--output: {saved}: writable" in err
    assert [p.name for p in saved.iterdir()] == ["samples_gsm8k.jsonl"]


@pytest.mark.parametrize("model", ["TINY", "someone/not-cached-model"])
def test_local_inputs_are_checked_before_the_hub(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch, no_model_load,
    model: str,
) -> None:  # fmt: skip
    # Offline, with neither the data set nor (second case) the model cached: the missing baseline is what
    # the user hears of, not the Hub.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("qerl_cli.data.datasets._in_local_cache", lambda hub_id: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = str(tiny_model_dir) if model == "TINY" else model
    rc, _, err = run(
        capsys, "eval", model, "--engine", "hf", "--benchmarks", "math500", "--baseline", "nowhere.json",
        "--dry-run",
    )  # fmt: skip
    assert rc == 2 and "nowhere.json not found: give the results.json of an earlier `qerl eval`" in err, err
    assert "Hub" not in err


def _saved_answers(folder: Path, model: str | None) -> Path:
    """An earlier run's output folder: its samples, and a results.json naming ``model`` as the generating
    run's (None: the samples alone, as a folder of copied samples has them)."""
    folder.mkdir()
    (folder / "samples_gsm8k.jsonl").write_text("")
    if model is not None:
        record = {
            "format": 2,
            "created": "2026-01-01T00:00:00",
            "model": model,
            "engine": "hf",
            "benchmarks": {},
        }
        (folder / "results.json").write_text(json.dumps(record))
    return folder


@pytest.mark.parametrize("recorded", ["Qwen/Qwen2.5-7B", None])
def test_a_model_other_than_the_rescored_answers_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, recorded: str | None
) -> None:
    """`qerl eval MODEL --rescore DIR` re-graded DIR's answers and said nothing of MODEL, which it never
    loaded: the scores read as MODEL's were those of the model that generated them."""
    saved = _saved_answers(tmp_path / "saved", recorded)
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    for dry in (["--dry-run"], []):
        rc, out, err = run(capsys, "eval", "other/model", "--rescore", str(saved), *dry)
        assert rc == 2 and "error:" in err, err
        assert f"MODEL other/model: --rescore re-grades the answers saved in {saved}," in err
        assert f"drop MODEL (`qerl eval --rescore {saved}`)" in err
        if recorded:
            assert f"generated by {recorded}" in err and f"give the one they came from, {recorded}" in err
        else:
            assert "which record no model that generated them" in err
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before


def test_the_model_the_rescored_answers_came_from_may_be_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    saved = _saved_answers(tmp_path / "saved", str(tmp_path / "m"))
    for model in (str(tmp_path / "m"), "m", "./m/"):  # the recorded folder, however it is spelt
        rc, _, err = run(capsys, "eval", model, "--rescore", str(saved), "--dry-run")
        assert rc == 0, err
    rc, _, err = run(capsys, "eval", "--set", "model=Qwen/Qwen2.5-7B", "--rescore", str(saved), "--dry-run")
    assert rc == 2 and f"generated by {tmp_path / 'm'}" in err, err


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--adapter", "ADAPTER"], "--adapter"),
        (["--engine", "hf", "--samples", "2"], "--samples, --engine"),
        (["--max-new-tokens", "64", "--max-problems", "3"], "--max-new-tokens, --max-problems"),
        (["--set", "temperature=1.0"], "temperature"),
        (["--set", "vllm_kwargs={enforce_eager: true}", "--set", "device=cpu"], "vllm_kwargs, device"),
        (["--set", "vllm_kwargs.enforce_eager=true"], "vllm_kwargs"),  # a dotted key: the key it sets in
        (["--config", "CONFIG"], "top_p"),
    ],
)
def test_a_generation_setting_given_with_rescore_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, adapter: Path, given: list[str], named: str
) -> None:
    """`qerl eval --rescore DIR` re-graded DIR's answers and ignored an --adapter, a temperature, an engine
    or a sample count given with it in silence: the scores read as those of settings never used."""
    saved = _saved_answers(tmp_path / "saved", None)
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"top_p": 0.5, "grader_workers": 1}))  # grader_workers: a rescore's
    argv = [str(adapter) if a == "ADAPTER" else str(config) if a == "CONFIG" else a for a in given]
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    for dry in (["--dry-run"], []):
        rc, out, err = run(capsys, "eval", "--rescore", str(saved), *argv, *dry)
        assert rc == 2 and "error:" in err, err
        assert f"{named}: --rescore re-grades the answers saved in {saved} and generates nothing" in err
        what = "these settings" if "," in named else "this setting"
        assert f"so {what} of generating would be ignored" in err
        assert f"(`qerl eval --rescore {saved}`), or leave --rescore out to generate with" in err
        assert out == ""  # refused before the dry run's YAML
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before


def test_the_settings_a_rescore_reads_are_kept(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The grader, the benchmarks re-graded, the template (stop strings), the output and a dry run's own
    YAML given back (every key at its default) still go with --rescore."""
    saved = _saved_answers(tmp_path / "saved", None)
    rc, out, err = run(
        capsys, "eval", "--rescore", str(saved), "--benchmarks", "gsm8k", "--set", "grader_workers=1",
        "--set", "grader_timeout_s=2", "--set", "template=qerl", "-o", str(tmp_path / "new"), "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    config = tmp_path / "dry.yaml"
    config.write_text(out)
    rc, _, err = run(capsys, "eval", "--config", str(config), "--dry-run")
    assert rc == 0, err


def test_an_adapter_trained_with_another_template_is_warned_of(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path,
    tiny_model_dir: Path, no_model_load,
) -> None:  # fmt: skip
    """`qerl eval BASE --adapter RUN/adapter` prompted with the default template whatever the run trained
    with: a tiny run trained on `plain` scored 0% (every answer "no answer"), with no word of why."""
    run_dir = tmp_path / "run"
    for adapter in (run_dir / "adapter", run_dir / "checkpoint-2" / "adapter"):
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 4}))
        (adapter / "adapter_model.safetensors").write_bytes(b"")
    (run_dir / "prompt.json").write_text(json.dumps({"name": "plain", "template_hash": "x"}))
    for adapter in (run_dir / "adapter", run_dir / "checkpoint-2" / "adapter"):
        argv = ["eval", str(tiny_model_dir), "--adapter", str(adapter), "--engine", "hf",
                "--benchmarks", "synthetic-addition", "--dry-run"]  # fmt: skip
        caplog.clear()
        rc, _, err = run(capsys, *argv)
        assert rc == 0, err
        assert "the adapter was trained with plain (--set template=plain evaluates it as trained)" in err
        warned = " ".join(caplog.text.split())
        record = run_dir / "prompt.json"
        assert f"the adapter {adapter} was trained with the prompt template plain ({record})" in warned
        assert "this evaluation prompts with qerl" in warned and "--set template=plain" in warned
        caplog.clear()
        rc, _, err = run(capsys, *argv, "--set", "template=plain")
        assert rc == 0 and "as the adapter was trained" in err and not caplog.text
    # An adapter from elsewhere (no run's record beside it) is evaluated as asked, without a word.
    (run_dir / "prompt.json").unlink()
    caplog.clear()
    rc, _, err = run(capsys, *argv)
    assert rc == 0 and "trained with" not in err and not caplog.text


def test_an_output_folder_of_another_evaluation_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, adapter: Path, no_model_load
) -> None:
    """`qerl eval BASE` then `qerl eval BASE --adapter A` (both into the default eval_results/) replaced the
    base's results.json and left its samples files of other benchmarks beside the new ones, where a
    rescore graded them as the adapter's."""
    out = tmp_path / "eval_results"
    out.mkdir()
    record = {"model": str(tiny_model_dir), "adapter": None, "engine": "hf", "benchmarks": {}}
    (out / "results.json").write_text(json.dumps(record))
    (out / "samples_synthetic-addition.jsonl").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    base = ["eval", str(tiny_model_dir), "--engine", "hf", "--benchmarks", "synthetic-addition"]
    base += ["-o", str(out)]
    for dry_run in ([], ["--dry-run"]):
        rc, _, err = run(capsys, *base, "--adapter", str(adapter), *dry_run)
        assert rc == 2 and f"--output {out} holds the results of another evaluation ({tiny_model_dir})" in err
        assert "nothing was changed" in err and f"--baseline {out / 'results.json'}" in err
    (out / "results.json").write_text(json.dumps({**record, "adapter": str(adapter)}))
    rc, _, err = run(capsys, *base, "--dry-run")  # the bare model over the adapter's evaluation
    assert rc == 2 and f"({tiny_model_dir} + adapter {adapter})" in err, err
    before["results.json"] = (out / "results.json").read_bytes()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # The same evaluation again (the model spelt otherwise) replaces it, as before.
    rc, _, err = run(capsys, *base, "--adapter", f"{adapter}/", "--dry-run")
    assert rc == 0 and "writable (results.json and the samples files replaced there)" in err, err
