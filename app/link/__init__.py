"""How the dashboard, tools and tests reach an engine: source (ROOT, ASSETS), launcher, wire, client, lab_run."""
