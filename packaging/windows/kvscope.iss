; Inno Setup script for KV Scope (Windows x64). Not buildable on Linux: see packaging/README.md.
;
;   python packaging\build.py                                   (dist\kvscope\ + frozen self-test)
;   iscc /DAppVersion=0.1.0 packaging\windows\kvscope.iss       (Inno Setup 6.5.2 or newer)
;   -> packaging\build-out\installer\KVScope-0.1.0-setup.exe (+ KVScope-0.1.0-setup-*.bin slices)
;
; Why Inno Setup and not NSIS: NSIS installers fail above ~2 GB ("Internal compiler error #12345: error
; mmapping datablock", pynsist #259, constructor #650), and a CUDA build of torch makes the bundle 3-5 GB.
; Inno Setup handles that with DiskSpanning (6.5.2 removed the old 2.1 GB DiskSliceSize cap).
; Per-user install (no admin, no UAC prompt), like Ollama's app/ollama.iss; an all-users install is
; offered through the privileges dialog.

#ifndef AppVersion
  #define AppVersion "0.0.0"
#endif
#ifndef DistDir
  ; the onedir bundle made by packaging\build.py (its default --out)
  #define DistDir "..\build-out\dist\kvscope"
#endif
#ifndef OutDir
  #define OutDir "..\build-out\installer"
#endif
#define AppName "KV Scope"
#define AppExe "kvscope.exe"

[Setup]
; AppId identifies the app for upgrades and uninstall: never change it
AppId={{CC5A19D9-2B00-4BB6-9C64-2B5F081E3182}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=KV Scope developers
; per-user by default: {autopf} is %LOCALAPPDATA%\Programs when not elevated
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
DefaultDirName={autopf}\KV Scope
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
UninstallDisplayName={#AppName}
UninstallDisplayIcon={app}\{#AppExe}
; torch/PySide6 wheels are x64 builds; runs on x64 and on Arm64 (x64 emulation)
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0.17763
OutputDir={#OutDir}
OutputBaseFilename=KVScope-{#AppVersion}-setup
#ifexist "..\..\resources\icons\kvscope.ico"
SetupIconFile=..\..\resources\icons\kvscope.ico
#endif
; Large payloads: a CPU build is ~0.9 GB unpacked, a CUDA torch build 3-5 GB. DiskSpanning writes
; setup.exe + .bin slices, so no single file needs 32-bit offsets; keep the slices next to setup.exe.
DiskSpanning=yes
DiskSliceSize=max
Compression=lzma2/max
SolidCompression=yes
LZMAUseSeparateProcess=yes
LZMANumBlockThreads=4
; the app is a folder of ~2,000 files: close a running copy before replacing them
CloseApplications=yes
RestartApplications=no
WizardStyle=modern
; Code signing (recommended: unsigned setup.exe + PyInstaller bootloader trip SmartScreen/Defender):
; define a sign tool in the IDE or pass /S"signtool=signtool sign /fd sha256 /tr http://timestamp.example /td sha256 $f"
; and uncomment:
;SignTool=signtool
;SignedUninstaller=yes

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[InstallDelete]
; an upgrade replaces the whole bundle: stale modules from an older version must not be imported
Type: filesandordirs; Name: "{app}\_internal"

[Files]
Source: "{#DistDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; settings and chat history (Qt's AppDataLocation, %APPDATA%\kvscope\kvscope) are kept; downloaded models stay in the
; Hugging Face cache (%USERPROFILE%\.cache\huggingface) where other tools can use them
Type: filesandordirs; Name: "{app}\_internal"
