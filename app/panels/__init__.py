"""What the dashboard draws: the grid and its lane, the tables, the header, the timeline, the event log
and the history's panels."""
