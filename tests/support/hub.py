"""huggingface_hub replaced by recorders (no network here): `FakeApi` records the repositories created and the
folders uploaded (filtered by the upload's patterns, as the real upload is), `FakeScheduler` the completions
pushes a CommitScheduler would make."""

from __future__ import annotations

import concurrent.futures
import os
from types import SimpleNamespace

from huggingface_hub.utils import filter_repo_objects


class FakeApi:
    calls: list = []
    fail = False

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, name, private=None, exist_ok=False, repo_type=None):
        FakeApi.calls.append(("create_repo", name, private, self.token) + ((repo_type,) if repo_type else ()))
        return SimpleNamespace(repo_id=name if "/" in name else f"me/{name}")

    def upload_folder(
        self,
        repo_id,
        folder_path,
        path_in_repo=None,
        commit_message=None,
        revision=None,
        allow_patterns=None,
        ignore_patterns=None,
        run_as_future=False,
    ):
        if FakeApi.fail:
            raise OSError("no network")
        every = [
            os.path.relpath(os.path.join(root, name), folder_path)
            for root, _, names in os.walk(folder_path)
            for name in names
        ]  # what huggingface_hub's upload_folder would send: every file, filtered by both pattern lists
        files = sorted(filter_repo_objects(every, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        FakeApi.calls.append(("upload", repo_id, os.path.basename(folder_path), path_in_repo, commit_message, files))
        future = concurrent.futures.Future()
        future.set_result("commit")
        return future if run_as_future else "commit"


class FakeScheduler:
    made: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.triggered = kwargs, 0
        FakeScheduler.made.append(self)

    def trigger(self):
        self.triggered += 1
        done = concurrent.futures.Future()
        done.set_result(None)
        return done
