"""What the views compute from the events: key events, lifetimes, prefix events, session misses, scenarios, words."""
