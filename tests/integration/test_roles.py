"""A shared dashboard (Streamlit beyond loopback): a viewer's session gets the live views and no
control, and the engine refuses what it sends anyway; the session that opened the presenter's
link gets every control, and its commands reach the engine (app/ui/roles.py, app/link/gate.py)."""
from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
import streamlit as st
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from kvscope_contract import protocol as p
from app.ui import roles
from tests.apptest import MAIN, grid_data, panels
from tests.waiting import wait


@pytest.fixture
def shared():
    """Streamlit's address as `--share` sets it, for this test's sessions."""
    before = st_config.get_option("server.address")
    st_config.set_option("server.address", "0.0.0.0")
    yield
    st_config.set_option("server.address", before)


def _key() -> str:
    return parse_qs(urlsplit(roles.presenter_link(8501)).query)[roles.PARAM][0]


def _session(engine, monkeypatch, key: str | None = None) -> AppTest:
    monkeypatch.setenv("KVSCOPE_ENGINE", engine.url)
    app = AppTest.from_file(MAIN, default_timeout=30)
    if key is not None:
        app.query_params[roles.PARAM] = key
    app.run()
    wait(lambda: grid_data(app.run()), what="the app's first grid")
    return app


def _labels(app: AppTest) -> set[str]:
    return {w.label for kind in ("button", "text_input", "radio", "toggle", "select_slider", "number_input",
                                 "text_area", "selectbox") for w in app.get(kind) if hasattr(w, "label")}


def _modes(app: AppTest) -> list[str]:
    (mode,) = [g for g in app.get("button_group") if g.key == "mode"]
    return list(mode.options)


def _sent_by_session(engine, key: str | None) -> str:
    """What a session's reset does: its own script, in a session of its own, sends a reset."""
    def script(url: str, key: str | None) -> None:
        import streamlit as st
        from kvscope_contract import protocol as p
        from app.link.client import EngineClient
        from app.link.gate import Refused
        from app.ui import roles
        roles.claim()
        from tests.waiting import wait
        c = EngineClient(url)
        wait(lambda: c.view() is not None, what="the session's client's first snapshot")
        try:
            reset = p.ResetCmd(config=p.ResetConfig(block_size=32, num_device_blocks=64))
            st.write(f"ack {type(c.wait_reply(c.send(reset), 15)).__name__}")
        except Refused as e:
            st.write(f"refused: {e}")
        finally:
            c.close()

    app = AppTest.from_function(script, args=(engine.url, key), default_timeout=30)
    if key is not None:
        app.query_params[roles.PARAM] = key
    app.run()
    return app.markdown[0].value


def test_a_viewer_has_no_control_and_its_commands_are_refused(engine, observer, shared, monkeypatch):
    st.cache_resource.clear()
    viewer = _session(engine, monkeypatch)
    labels = _labels(viewer)
    for control in ("Connect", "Source", "Engine URL", "Token", "Submit", "Reset engine", "Clear prefix cache",
                    "Clean slate", "Run to the next key event", "Restart it when it dies"):
        assert control not in labels, f"a viewer sees {control!r}"
    assert not viewer.sidebar.expander or all(e.label != "Connection" for e in viewer.sidebar.expander)
    assert _modes(viewer) == ["Explore", "Lessons"]  # the presenter's lesson read along; never the Lab
    viewer.segmented_control(key="mode").set_value("Lessons").run()
    assert "The presenter has no lesson running" in " ".join(i.value for i in viewer.info)
    assert not {"Start the lesson", "Next", "Back", "Restart", "Lesson"} & _labels(viewer)  # no picker, no control
    viewer.segmented_control(key="mode").set_value("Explore").run()
    assert "Connected" in panels(viewer)["status"] and engine.url not in panels(viewer)["status"]

    before = observer.view().mirror.config
    assert _sent_by_session(engine, None) == f"refused: {roles.REFUSED}"
    assert _sent_by_session(engine, "not-the-key") == f"refused: {roles.REFUSED}"
    assert observer.view().mirror.config == before  # the engine never heard of it
    st.cache_resource.clear()


def test_the_presenters_session_has_every_control_and_drives_the_engine(engine, observer, shared, monkeypatch):
    st.cache_resource.clear()
    presenter = _session(engine, monkeypatch, _key())
    assert roles.PARAM not in presenter.query_params  # the key left the address bar
    labels = _labels(presenter)
    for control in ("Connect", "Source", "Submit", "Clear prefix cache", "Clean slate"):
        assert control in labels, f"the presenter lacks {control!r}"
    assert _modes(presenter) == ["Explore", "Lessons", "Lab"]
    assert engine.url in panels(presenter)["status"]

    assert _sent_by_session(engine, _key()) == "ack Ack"
    wait(lambda: observer.view().mirror.config.block_size == 32, what="the presenter's reset")
    assert isinstance(observer.wait_reply(observer.send(p.ResetCmd(config=p.ResetConfig(
        block_size=16, num_device_blocks=256, num_host_blocks=128, max_num_seqs=16)))), p.Ack)
    st.cache_resource.clear()


def test_on_loopback_every_session_drives(engine, observer):
    assert not roles.shared()  # AppTest, as `streamlit run app/main.py`: loopback (or nowhere)
    assert _sent_by_session(engine, None) == "ack Ack"
    wait(lambda: observer.view().mirror.config.block_size == 32, what="the reset")
    assert isinstance(observer.wait_reply(observer.send(p.ResetCmd(config=p.ResetConfig(
        block_size=16, num_device_blocks=256, num_host_blocks=128, max_num_seqs=16)))), p.Ack)


def test_the_command_lines_token_reaches_no_browser_and_is_kept(engine, observer, monkeypatch):
    """`--token` (KVSCOPE_TOKEN) stays on the server: the Token field is empty, even for the
    presenter, and Connect without typing one keeps it."""
    from app.link.source import Source
    from app.ui import controls
    monkeypatch.setenv("KVSCOPE_TOKEN", "s3cret-of-the-cli")
    st.cache_resource.clear()
    app = _session(engine, monkeypatch)
    assert app.text_input(key="src_token").value == ""
    assert "s3cret-of-the-cli" not in str([el.proto for el in app.get("text_input")] + [panels(app)])
    attached = Source("attach", url=engine.url, token="s3cret-of-the-cli")
    assert controls.chosen(attached, {"src_kind": "attach", "src_url": engine.url, "src_token": ""}) == attached
    elsewhere = {"src_kind": "attach", "src_url": "ws://elsewhere:1/", "src_token": ""}
    assert controls.chosen(attached, elsewhere).token == ""
    st.cache_resource.clear()
