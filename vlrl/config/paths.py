"""Start-up checks of model paths and hub names: local or hub, decided by a fixed rule, in seconds.

Rule (docs/config.md, README "Configuration"): a value is a **local path** when it exists, is
absolute, starts with `.` or `~`, has more than one `/`, or its first component is an existing
folder (`outputs/quickstart_model` while `outputs/` exists). A missing local path is an error at
once, naming the closest folder that exists. Otherwise a value of the form `name` or `org/name`
is a **hub id**: it is accepted when it is in the local Hugging Face cache; else, offline
(`HF_HUB_OFFLINE=1`) is an error saying so, and online the hub must answer within a few seconds
(no network is an error saying so; an unknown repo too).

Relative local paths are made absolute at config load (`make_paths_absolute`, called by
`PPOConfig.derive`), against the folder `python -m vlrl.trainer.main` was launched from, because
Ray rank workers run in their raylet's folder, not the driver's. An input (model, tokenizer, data,
reward and tool files, format prompt, chat template file, image folder, checkpoint to load) is made
absolute when it exists there; a hub id, a Jinja string, a missing path or a `~` path stays as
written. Outputs (`trainer.save_checkpoint_path`, `ray_timeline`, `plot_path`,
`data.image_check_cache_dir`) are always local: `~` is expanded and they are made absolute.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any
from urllib.parse import urlparse

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
CONNECT_TIMEOUT = 3.0
"""Seconds to wait for the hub's TCP port before calling the network unreachable."""


def looks_local(value: str) -> bool:
    """Whether `value` names a local path under the rule above (it need not exist)."""
    if os.path.exists(value) or os.path.isabs(value) or value.startswith((".", "~")):
        return True
    if value.count("/") > 1 or os.sep in value.replace("/", "") or "\\" in value:
        return True
    first = value.split("/", 1)[0]
    return "/" in value and os.path.isdir(first)


def closest_existing(path: str) -> str:
    """Description of the deepest existing parent folder of `path` and a few of its entries."""
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    try:
        names = sorted(n for n in os.listdir(parent) if not n.startswith("."))
    except OSError:
        return ""
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" (closest existing folder: {parent}, holding: {shown or 'nothing'})"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "") in (
        "1",
        "true",
        "True",
    )


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _unreachable(endpoint: str) -> str | None:
    """None when the hub's host accepts a TCP connection within CONNECT_TIMEOUT, else the reason."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=CONNECT_TIMEOUT).close()
    except OSError as err:
        return f"{url.hostname}:{port} cannot be reached ({err})"
    return None


def _in_cache(repo: str, repo_type: str) -> bool:
    if repo_type == "model":
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    import datasets

    folder = os.path.join(datasets.config.HF_DATASETS_CACHE, repo.replace("/", "___"))
    return os.path.isdir(folder)


def _hub_problem(repo: str, repo_type: str) -> str | None:
    """Why hub repo `repo` cannot be used now, or None."""
    if _in_cache(repo, repo_type):
        return None
    if _offline():
        return "it is not in the local cache and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set (offline)"
    # Behind a proxy a direct connection proves nothing: let the (proxied) hub request below decide.
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    reason = None if proxied else _unreachable(hub_endpoint())
    if reason is not None:
        return f"it is not in the local cache and the hub is unreachable: {reason} (no network?)"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().repo_info(repo, repo_type=repo_type, timeout=10)
    except RepositoryNotFoundError:
        return "no such repository on the hub (or it is private: log in with `hf auth login`)"
    except Exception as err:
        # No connection (e.g. through a proxy): the HTTP client's TransportError (huggingface_hub 2.4
        # uses a renamed httpx, so match by class name). Other trouble (rate limits, gated repos...):
        # loading will report it.
        if isinstance(err, OSError) or any(c.__name__ == "TransportError" for c in type(err).__mro__):
            return f"it is not in the local cache and the hub did not answer ({type(err).__name__}: {err})"
        return None
    return None


def model_path_problem(value: str) -> str | None:
    """Why `value` is not a usable model folder or hub model id, or None."""
    if os.path.isdir(value):
        return None
    if os.path.exists(value):
        return f"{value!r} is a file, not a model folder"
    if value.startswith("~") and os.path.isdir(os.path.expanduser(value)):
        return f"{value!r}: '~' is not expanded in model paths; write {os.path.expanduser(value)!r}"
    if looks_local(value) or not HUB_ID.match(value):
        return f"local folder {value!r} does not exist{closest_existing(value)}"
    problem = _hub_problem(value, "model")
    if problem is None:
        return None
    return f"{value!r} is not a local folder and was read as a hub model id, but {problem}"


def hub_dataset_problem(entry: str) -> str | None:
    """Why hub dataset `org/name@split` cannot be loaded now, or None."""
    problem = _hub_problem(entry.split("@", 1)[0], "dataset")
    if problem is None:
        return None
    return f"{entry!r} is not a local file and was read as a hub dataset, but {problem}"


# ------------------------------------------------------------------ absolute local paths
# Every config key naming a local file or folder, and how to make its value absolute. A Ray rank
# worker runs in the folder its raylet was started in (`ray start` on another node, or in another
# folder), not in the folder the run was launched from, so a relative path would name nothing
# there (or another file). The driver's other processes inherit its folder, but one rule for all
# keys is easier to trust, and the log shows every path as the run will use it.
PATH_KEYS = {
    "data.train_files": "data",
    "data.val_files": "data",
    "data.image_dir": "input",
    "data.format_prompt": "input",
    "data.override_chat_template": "input",  # a Jinja string never names an existing file
    "data.image_check_cache_dir": "output",
    "worker.actor.model.model_path": "input",
    "worker.actor.model.tokenizer_path": "input",
    "worker.reward.reward_function": "spec",
    "worker.rollout.multi_turn.tools": "spec",
    "worker.rollout.multi_turn.tool_config_path": "input",
    "worker.rollout.multi_turn.interaction": "spec",
    "trainer.save_checkpoint_path": "output",
    "trainer.load_checkpoint_path": "input",
    "trainer.ray_timeline": "output",
    "trainer.plot_path": "output",
}
"""Dotted config key -> kind: input (absolute when it exists), output (always local: `~` expanded,
absolute), spec (`file.py:function`, the file as an input) or data (comma list of `FILE[@split]`)."""


def absolute_input(value: str | None) -> str | None:
    """`value` made absolute when it names an existing file or folder (seen from the launch
    folder); anything else stays as written: a hub id, a Jinja string, a missing path (the start-up
    checks name it as the user wrote it) and `~/...` (never expanded for inputs: the model check
    says so)."""
    if not value or value.startswith("~") or not os.path.exists(value):
        return value
    return os.path.abspath(value)


def absolute_output(value: str | None) -> str | None:
    """An output path (checkpoints, traces, plots, caches): local by nature, so always absolute."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


def absolute_spec(spec: str | None) -> str | None:
    """`path/to/file.py:function` with the file made absolute when it exists (`:function` is
    optional, as in `vlrl.rewards.loading.parse_spec`)."""
    if not spec:
        return spec
    path, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and not path.startswith("~") and os.path.exists(path):
        return f"{os.path.abspath(path)}:{name}"
    return absolute_input(spec)


def absolute_data(spec: str | None) -> str | None:
    """Each local entry of a comma list of `FILE`, `FOLDER`, `FILE@split` made absolute; hub
    datasets (`org/name@split`) and missing entries stay as written. Unchanged text when no entry
    changes."""
    if not spec:
        return spec
    entries = [entry.strip() for entry in spec.split(",")]
    absolute = [_absolute_data_entry(entry) for entry in entries]
    return spec if absolute == entries else ",".join(absolute)


def _absolute_data_entry(entry: str) -> str:
    if not entry or entry.startswith("~"):
        return entry
    if os.path.exists(entry):
        return os.path.abspath(entry)
    path, at, split = entry.rpartition("@")  # the split suffix of vlrl.data.sources
    if at and split and os.path.exists(path):
        return f"{os.path.abspath(path)}@{split}"
    return entry


_MAKE_ABSOLUTE = {
    "input": absolute_input,
    "output": absolute_output,
    "spec": absolute_spec,
    "data": absolute_data,
}


def make_paths_absolute(config: Any) -> list[tuple[str, Any, Any]]:
    """Rewrite every `PATH_KEYS` value of `config` (a `PPOConfig`) by its kind's rule, against the
    current working folder (the launch folder). Returns (key, before, after) for each value that
    changed; a second call changes nothing."""
    changed = []
    for key, kind in PATH_KEYS.items():
        *parents, name = key.split(".")
        section = config
        for part in parents:
            section = getattr(section, part)
        before = getattr(section, name)
        convert = _MAKE_ABSOLUTE[kind]
        after = [convert(v) for v in before] if isinstance(before, list) else convert(before)
        if after != before:
            setattr(section, name, after)
            changed.append((key, before, after))
    return changed
