# Installs what a distribution would ship for colibrid: systemd units, sysusers.d and tmpfiles.d
# snippets, udev rules, a sysctl.d file and the config. The Python package (colibrid, colibrictl)
# is installed by pip: `pip install .` (a system pip puts the commands in /usr/local/bin).
#
#   make install                      # into /usr/local/... and /etc/colibri
#   make install PREFIX=/usr          # where a distribution package puts them
#   make install DESTDIR=/tmp/stage   # staged, for packaging
#   make install BINDIR=/opt/venv/bin # colibrid installed elsewhere (a virtualenv)
#
# systemd, udev, sysusers, tmpfiles and sysctl all read /usr/local/lib/... as well as /usr/lib/...
# After a real install (no DESTDIR), `make activate` creates the user, loads the rules and
# enables the socket; docs/systemd.md explains each step.

PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
LIBDIR ?= $(PREFIX)/lib
UNITDIR ?= $(LIBDIR)/systemd/system
SYSUSERSDIR ?= $(LIBDIR)/sysusers.d
TMPFILESDIR ?= $(LIBDIR)/tmpfiles.d
UDEVRULESDIR ?= $(LIBDIR)/udev/rules.d
SYSCTLDIR ?= $(LIBDIR)/sysctl.d
DOCDIR ?= $(PREFIX)/share/doc/colibri

INSTALL ?= install
# The documents installed next to the units (their Documentation= names two); install and
# uninstall both read this one list, so they cannot drift apart.
DOCS = systemd.md protocol.md thermal.md security.md gateway.md rawdev.md
# The units (and the udev rule's probe) name executables and the docs by absolute path, known only at install.
SUBSTITUTE = sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@DOCDIR@|$(DOCDIR)|g'

.PHONY: all install uninstall activate

all:
	@echo "nothing to build here (pip install . builds colibrid); try: make install [DESTDIR=...] [PREFIX=...]"

install:
	$(INSTALL) -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(TMPFILESDIR) \
		$(DESTDIR)$(UDEVRULESDIR) $(DESTDIR)$(SYSCTLDIR) $(DESTDIR)$(DOCDIR) $(DESTDIR)$(SYSCONFDIR)/colibri
	$(SUBSTITUTE) systemd/colibrid.service > $(DESTDIR)$(UNITDIR)/colibrid.service
	$(SUBSTITUTE) systemd/colibrid.socket > $(DESTDIR)$(UNITDIR)/colibrid.socket
	$(SUBSTITUTE) systemd/colibri-openai.service > $(DESTDIR)$(UNITDIR)/colibri-openai.service
	$(SUBSTITUTE) systemd/colibri-openai.socket > $(DESTDIR)$(UNITDIR)/colibri-openai.socket
	chmod 0644 $(DESTDIR)$(UNITDIR)/colibrid.service $(DESTDIR)$(UNITDIR)/colibrid.socket \
		$(DESTDIR)$(UNITDIR)/colibri-openai.service $(DESTDIR)$(UNITDIR)/colibri-openai.socket
	$(INSTALL) -m 0644 systemd/sysusers.d/colibri.conf $(DESTDIR)$(SYSUSERSDIR)/colibri.conf
	$(INSTALL) -m 0644 systemd/tmpfiles.d/colibri.conf $(DESTDIR)$(TMPFILESDIR)/colibri.conf
	$(INSTALL) -m 0644 udev/60-colibri-nvme.rules $(DESTDIR)$(UDEVRULESDIR)/60-colibri-nvme.rules
	$(SUBSTITUTE) udev/61-colibri-pack.rules > $(DESTDIR)$(UDEVRULESDIR)/61-colibri-pack.rules
	chmod 0644 $(DESTDIR)$(UDEVRULESDIR)/61-colibri-pack.rules
	$(INSTALL) -m 0644 etc/sysctl.d/60-colibri.conf $(DESTDIR)$(SYSCTLDIR)/60-colibri.conf
	$(INSTALL) -m 0644 $(addprefix docs/,$(DOCS)) $(DESTDIR)$(DOCDIR)/
	@# The config is the admin's once installed: never overwrite an edited one.
	test -e $(DESTDIR)$(SYSCONFDIR)/colibri/colibrid.toml || \
		$(INSTALL) -m 0644 etc/colibri/colibrid.toml $(DESTDIR)$(SYSCONFDIR)/colibri/colibrid.toml
	test -e $(DESTDIR)$(SYSCONFDIR)/colibri/colibri-openai.toml || \
		$(INSTALL) -m 0644 etc/colibri/colibri-openai.toml $(DESTDIR)$(SYSCONFDIR)/colibri/colibri-openai.toml

uninstall:
	rm -f $(DESTDIR)$(UNITDIR)/colibrid.service $(DESTDIR)$(UNITDIR)/colibrid.socket \
		$(DESTDIR)$(UNITDIR)/colibri-openai.service $(DESTDIR)$(UNITDIR)/colibri-openai.socket \
		$(DESTDIR)$(SYSUSERSDIR)/colibri.conf $(DESTDIR)$(TMPFILESDIR)/colibri.conf \
		$(DESTDIR)$(UDEVRULESDIR)/60-colibri-nvme.rules $(DESTDIR)$(UDEVRULESDIR)/61-colibri-pack.rules \
		$(DESTDIR)$(SYSCTLDIR)/60-colibri.conf \
		$(addprefix $(DESTDIR)$(DOCDIR)/,$(DOCS))
	-rmdir $(DESTDIR)$(DOCDIR) 2>/dev/null
	@echo "left in place: $(SYSCONFDIR)/colibri/colibrid.toml, colibri-openai.toml, /var/lib/colibri and the colibri user"

activate:
	systemd-sysusers $(SYSUSERSDIR)/colibri.conf
	systemd-tmpfiles --create $(TMPFILESDIR)/colibri.conf
	sysctl -p $(SYSCTLDIR)/60-colibri.conf
	udevadm control --reload && udevadm trigger --subsystem-match=block --subsystem-match=nvme
	systemctl daemon-reload
	systemctl enable --now colibrid.socket
