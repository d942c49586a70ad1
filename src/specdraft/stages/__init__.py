"""Layer 6 -- one module per `specdraft <stage>`: its config and its run function, nothing another stage
imports (stages never import each other; what two stages share lives in a lower layer)."""
