"""Effects of the Hub fields, with huggingface_hub's API replaced by test_hub's recorder (no network here)."""

from __future__ import annotations

from unittest import mock

from support.field_effects import Setting, effect


def _run(s: Setting, **more):
    from support.hub import FakeApi

    FakeApi.calls, FakeApi.fail = [], False
    settings = dict(push_to_hub=True, max_steps=2, save_strategy="steps", save_steps=1)
    settings.update(more)
    with mock.patch("huggingface_hub.HfApi", FakeApi):
        s.train(**settings)
    return FakeApi.calls


def _uploads(calls):
    return [c for c in calls if c[0] == "upload"]


@effect("push_to_hub", True)
def _(s: Setting) -> None:
    calls = _run(s)
    assert calls[0][0] == "create_repo" and len(_uploads(calls)) == 2  # every_save: one push per checkpoint


@effect("hub_token", "hf_secret")
def _(s: Setting) -> None:
    assert _run(s)[0][3] == "hf_secret"
    assert s.config().to_dict()["hub_token"] == "<redacted>"


@effect("hub_private_repo", True)
def _(s: Setting) -> None:
    assert _run(s)[0][2] is True


@effect("hub_model_id", "someone/my-run")
def _(s: Setting) -> None:
    calls = _run(s)
    assert calls[0][1] == "someone/my-run" and all(c[1] == "someone/my-run" for c in _uploads(calls))


@effect("hub_strategy", "end")
def _(s: Setting) -> None:
    assert _uploads(_run(s)) == []


@effect("hub_always_push", True)
def _(s: Setting) -> None:
    import concurrent.futures

    from support.hub import FakeApi

    never = concurrent.futures.Future()  # a push that never finishes: without hub_always_push the next is skipped
    original = FakeApi.upload_folder
    with mock.patch.object(FakeApi, "upload_folder", lambda self, *a, **k: original(self, *a, **k) and never):
        assert len(_uploads(_run(s))) == 2


@effect("hub_revision", "dev")
def _(s: Setting) -> None:
    from support.hub import FakeApi

    seen = []
    original = FakeApi.upload_folder

    def record(self, *args, revision=None, **kw):
        seen.append(revision)
        return original(self, *args, revision=revision, **kw)

    with mock.patch.object(FakeApi, "upload_folder", record):
        _run(s)
    assert seen == ["dev", "dev"]


@effect("log_completions_hub_repo", "me/completions")
def _(s: Setting) -> None:
    from support.hub import FakeApi, FakeScheduler

    FakeApi.calls, FakeScheduler.made = [], []
    with (
        mock.patch("huggingface_hub.HfApi", FakeApi),
        mock.patch("huggingface_hub.CommitScheduler", FakeScheduler),
        mock.patch("huggingface_hub.DatasetCard.push_to_hub", lambda card, repo, **kw: None),
    ):
        s.train(log_completions=True)
    assert [m.kwargs["repo_id"] for m in FakeScheduler.made] == ["me/completions"]
