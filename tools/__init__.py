"""Developer tools that drive the dashboard in a real browser: the docs' screenshots and the
offline demo recording."""
