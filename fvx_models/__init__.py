"""Model families: stateless wrappers around diffusers DiTs."""
