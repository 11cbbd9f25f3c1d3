"""The dashboard's chrome: sidebar controls, time travel, the shared connection, command
replies and the palette."""
