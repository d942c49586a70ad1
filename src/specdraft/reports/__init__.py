"""Reports: what a reader sees -- markdown and PNG plots -- rendered from the records (JSON) the stages and the
demo write. Nothing here computes a figure; a report can be rendered again from its record alone."""
