"""The dashboard's pages beyond Explore: Lessons, the Lab, a ZMQ KV-event source and the fleet.
Each draws; a page's logic lives in app/data/ (the lessons' in app/data/lessons/)."""
