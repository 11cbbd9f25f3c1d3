"""The lessons' model, below the UI: each `*.toml` here is a lesson over the live engine
(`lesson.py` reads and checks it, `runner.py` walks its stops), `fleet/*.toml` a lesson over two
engines of a fleet (`fleet_lesson.py`). The pages that draw them live in app/modes/."""
