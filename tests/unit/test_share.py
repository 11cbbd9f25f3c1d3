"""`--share` (kvscope, python -m app, make run): Streamlit listens on every interface, the
presenter's key goes to the app through the environment, never argv (app/streamlit_argv.py)."""
from __future__ import annotations

from app.streamlit_argv import PRESENTER_KEY, share, streamlit_argv


def test_share_listens_everywhere_and_hands_the_key_over_in_the_environment(capsys):
    env: dict[str, str] = {"STREAMLIT_SERVER_PORT": "8502"}
    args, options = share(["--replay", "demo_recording.jsonl", "--share"], env)
    argv = streamlit_argv("python", args, *options)
    assert options == ("--server.address", "0.0.0.0") and "--share" not in argv
    key = env[PRESENTER_KEY]
    assert len(key) >= 24 and not any(key in a for a in argv)
    said = capsys.readouterr().out
    assert f"http://localhost:8502/?presenter={key}" in said and ":8502 " in said


def test_without_share_nothing_changes():
    env: dict[str, str] = {}
    assert share(["--model", "tiny"], env) == (["--model", "tiny"], ()) and env == {}
