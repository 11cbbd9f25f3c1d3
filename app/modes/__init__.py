"""The dashboard's pages beyond Explore: Lessons, the Lab, a ZMQ KV-event source and the fleet.
Each draws; a page's logic lives in the data packages below (the lessons' in app/lessons/)."""
