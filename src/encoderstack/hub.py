"""Publishing EncoderStack models to the Hugging Face Hub: check the whole folder first, then send it in one commit.

The Hub endpoint and the token are huggingface_hub's usual ones (`HF_ENDPOINT`, `HF_TOKEN` or `hf auth login`).
"""

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open

from .checkpoint import CODE_FILES, expected_tensors
from .hub_card import CARD_NAME, HubError, build_card, read_folder_config, write_card
from .modeling_encoderstack import AUTO_MAP

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def listed(keys, most: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def weight_problems(folder: Path, config, class_name: str) -> list[str]:
    """Whether the safetensors weights open and hold exactly the tensors `class_name` stores, with their shapes."""
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return [f"{index.name}: not a readable safetensors index ({error})"]
    elif (folder / WEIGHTS_NAME).is_file():
        shards = [WEIGHTS_NAME]
    else:
        return [f"{WEIGHTS_NAME}: missing (pushes carry safetensors weights only)"]
    shapes = {}
    for shard in shards:
        try:
            with safe_open(folder / shard, framework="pt") as weights:
                shapes.update({key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()})  # noqa: SIM118
        except (OSError, SafetensorError) as error:
            return [f"{shard}: not a readable safetensors file ({error})"]
    expected = expected_tensors(config, class_name)
    where = WEIGHTS_INDEX_NAME if index.is_file() else WEIGHTS_NAME
    problems = []
    if missing := expected.keys() - shapes.keys():
        problems.append(f"{where}: lacks {len(missing)} tensors of {class_name}: {listed(missing)}")
    if unexpected := shapes.keys() - expected.keys():
        problems.append(f"{where}: holds {len(unexpected)} tensors {class_name} does not have: {listed(unexpected)}")
    if wrong := [key for key in expected.keys() & shapes.keys() if shapes[key] != expected[key]]:
        problems.append(f"{where}: {len(wrong)} tensors have another shape than the config gives: {listed(wrong)}")
    return problems


def card_problem(folder: Path) -> str | None:
    path = folder / CARD_NAME
    if not path.is_file():
        return f"{CARD_NAME}: missing (`encoderstack card {folder}` writes it)"
    try:
        card = ModelCard.load(path)
    except (yaml.YAMLError, ValueError, TypeError) as error:  # broken YAML, or metadata ModelCardData refuses
        return f"{CARD_NAME}: metadata not readable ({error})"
    if card.data.library_name != "transformers" or "encoderstack" not in (card.data.tags or []):
        return (
            f"{CARD_NAME}: not an EncoderStack card (its metadata needs `library_name: transformers` and the tag "
            f"`encoderstack`; `encoderstack card {folder}` writes one)"
        )
    return None


def check_folder(folder) -> None:
    """Everything a push needs, checked locally: raises HubError naming every problem found."""
    folder = Path(folder)
    problems = []
    try:
        config, class_name = read_folder_config(folder)
        problems += weight_problems(folder, config, class_name)
    except HubError as error:
        problems.append(str(error))
    problems += [
        f"{name}: missing (`trust_remote_code=True` loads the model from it)"
        for name in CODE_FILES
        if not (folder / name).is_file()
    ]
    problems += [problem for problem in [card_problem(folder)] if problem]
    if problems:
        raise HubError(f"{folder}: not pushed (nothing was sent): " + "; ".join(problems))


def commit_operations(folder: Path, card: ModelCard | None) -> list[CommitOperationAdd]:
    """Every file of the folder except hidden ones and caches, with `card` (when given) for the folder's, and a config
    with the full auto_map."""
    replaced = {CARD_NAME: str(card).encode()} if card is not None else {}
    config = json.loads((folder / "config.json").read_text())
    if config.get("auto_map") != AUTO_MAP:
        config["auto_map"] = AUTO_MAP
        replaced["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    operations = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            name = relative.as_posix()
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=replaced.get(name, path)))
    return operations


def push_folder(
    folder,
    repo_id: str,
    private: bool | None = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    *,
    commit_description: str | None = None,
    create_pr: bool = False,
):
    """Publish an EncoderStack folder as the Hub repository `repo_id` (created if missing), in one commit: weights,
    config (with the full auto_map), the two code files, the tokenizer and the card, and anything else in the folder.
    `revision` is a branch, created if missing. Returns the commit's `CommitInfo` (a str: the commit URL).

    Nothing is sent before the whole folder has been checked (see `check_folder`); the Hub then validates the card
    before anything is created. A card that `encoderstack card` wrote and nobody edited since gets `repo_id` in its
    loading examples (the folder's own README.md is left as it is)."""
    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubError(f"{repo_id!r}: not a Hub repository id (nothing was sent): {error}") from None
    check_folder(folder)
    card = ModelCard.load(folder / CARD_NAME)
    unedited = str(card) == str(build_card(folder))
    if unedited:
        card = build_card(folder, repo_id)
    operations = commit_operations(folder, card if unedited else None)
    api = HfApi(token=token)
    with refusals_reported(repo_id, api.endpoint):
        try:
            card.validate()
        except ValueError as error:  # the Hub's answer to metadata it does not accept
            raise HubError(f"{folder / CARD_NAME}: the Hub rejects its metadata: {error}") from None
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload {folder.name}",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def transport_errors() -> tuple[type[Exception], ...]:
    """Errors of a request that got no answer: huggingface_hub 1.x sends through httpx, 2.x through httpx2 (whichever
    it imported), and offline mode raises a ConnectionError."""
    return (
        ConnectionError,
        TimeoutError,
        *(sys.modules[name].RequestError for name in ("httpx", "httpx2") if name in sys.modules),
    )


@contextmanager
def refusals_reported(repo_id: str, endpoint: str):
    try:
        yield
    except HfHubHTTPError as error:
        raise HubError(f"{repo_id}: the Hub refused the push: {error}") from None
    except transport_errors() as error:
        raise HubError(f"{repo_id}: not pushed: cannot reach the Hub at {endpoint} ({error})") from None


def push_model(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size="50GB",
    tags=None,
):
    """`push_to_hub` of every EncoderStack class: save, write the EncoderStack card, check, push in one commit."""
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    with tempfile.TemporaryDirectory(prefix="encoderstack-push-") as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        write_card(folder, repo_id, extra_tags=[*(model.model_tags or []), *tags])
        return push_folder(
            folder,
            repo_id,
            private=private,
            revision=revision,
            token=token,
            commit_message=commit_message or f"Upload {type(model).__name__}",
            commit_description=commit_description,
            create_pr=create_pr,
        )


__all__ = ["CODE_FILES", "check_folder", "push_folder", "push_model"]
